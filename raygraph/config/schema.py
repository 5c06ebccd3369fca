"""The config schema: one pydantic model per concern, every key documented once, here and in
`raygraph.config.training_schema` (what is trained and how: optimizers, actor, critic, reference,
reward, algorithm) and `raygraph.config.rollout_schema` (how rollouts are generated).

Every model forbids unknown keys and is frozen (use `cfg.model_copy(update=...)` to derive a
changed copy). Only single-field rules live here (types, ranges); rules that relate several
keys live in `raygraph.config.checks`, and `raygraph.config.loading` turns both into messages.
Relative paths are relative to the working directory of the `raygraph` command; paths to user
code (`plugins`, `file.py:fn` references) are stored absolute, so every actor imports the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from raygraph.algos import advantages
from raygraph.algos.user_code import absolute_ref
from raygraph.config.role_kinds import ROLES  # re-exported: the built-in role names
from raygraph.config.rollout_schema import RolloutConfig
from raygraph.config.section import Section
from raygraph.config.training_schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    ExtraRoleConfig,
    JudgeConfig,
    KLInRewardConfig,
    LoraConfig,
    OptimConfig,
    ReferenceConfig,
    RemoteRewardConfig,
    RewardConfig,
    RolloutCorrectionConfig,
)

__all__ = [
    "RaygraphConfig", "ModelConfig", "LoraConfig", "DataConfig", "ToyDataConfig", "RolloutConfig", "OptimConfig",
    "ActorConfig", "CriticConfig", "ReferenceConfig", "ExtraRoleConfig", "RewardConfig", "RemoteRewardConfig", "JudgeConfig",
    "AlgorithmConfig", "RolloutCorrectionConfig", "KLInRewardConfig", "PlacementConfig", "PoolConfig", "TrainerConfig",
    "WarmStartConfig", "LoggingConfig", "CheckpointConfig",
    "ROLES", "estimator_needs", "tiny_model_dir",
]



def estimator_needs(name: str | None) -> frozenset[str]:
    """What advantage estimator `name` needs, as declared where it is registered
    (`raygraph.algos.advantages.requires`); empty for None or an unknown name."""
    if name is None or name not in advantages.names():
        return frozenset()
    return advantages.requires(name)


def tiny_model_dir(output_dir: str, preset: str) -> str:
    """Where `model.tiny: <preset>` builds (or finds) its model: `<output_dir>/models/tiny-<preset>`."""
    return str(Path(output_dir) / "models" / f"tiny-{preset}")


Strategy = Literal["PACK", "SPREAD", "STRICT_SPREAD"]


class ModelConfig(Section):
    """The policy model: a real one at `path`, or a random-init tiny one named by `tiny`.

    A tiny model is named, not pathed: `tiny: <preset>` builds it on first use (or reuses it) at
    `<trainer.output_dir>/models/tiny-<preset>` (`tiny_model_dir`), which becomes `path`. So there is
    no path to misspell, and a missing `path` is never replaced by a random model. The derived
    `path` is left out of dumps (the resolved config.yaml), so a run's config loads back and
    resumes under another output folder."""

    path: str = Field(description="HF model id or local directory of the policy (and default for "
                                  "critic/reference/tokenizer). Required unless model.tiny is set, which derives "
                                  "it (<trainer.output_dir>/models/tiny-<preset>): leave it out then.")
    tiny: Literal["tiny", "small", "25m", "100m", "500m"] | None = Field(
        None, description="Train a random-init tiny model of this size preset (raygraph.models.tiny), for CPU "
        "demos and tests: built on first use, or reused, at <trainer.output_dir>/models/tiny-<preset>. "
        "null = a real model at model.path.")
    tokenizer_path: str | None = Field(None, description="Tokenizer id or directory; null = model.path.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype for every model of the run (bfloat16 on GPUs).")
    attn_impl: Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] = Field(
        "auto", description="Attention backend; auto = flash_attention_2 when installed on a GPU, else sdpa.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass "
                                                            "(saves memory, costs ~30% time).")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of every weight (docs/lora.md): "
                                "the base stays frozen, the reference is the policy with its adapter "
                                "disabled (no reference model), and weight syncs move the adapter only "
                                "(merged weights to the vLLM engine). null = full fine-tuning.")

    @model_serializer(mode="wrap")
    def _without_derived_path(self, handler):
        """A tiny model's path is derived from trainer.output_dir: not written, derived again on load."""
        data = handler(self)
        if self.tiny is not None:
            data.pop("path", None)
        return data


class ToyDataConfig(Section):
    task: Literal["arith", "word_problems", "tool_arith"] = Field(
        "arith", description="arith: 'a+b=' -> (a+b) mod 10 for the tiny demo model (raygraph.data.toy); "
        "word_problems: arithmetic word problems answered as '#### <n>' for a real instruct model "
        "(raygraph.data.word_problems); tool_arith: 3-digit x 2-digit products with a calculator tool, and a "
        "warm start showing the call (raygraph.data.tool_arith). task_args is for arith only.")
    n_train: int = Field(80, ge=1, description="Training problems to generate (distinct from validation).")
    n_val: int = Field(20, ge=1, description="Held-out validation problems to generate; the default task "
                       "has 100 problems in all (task_args.max_operand raises that).")
    seed: int = Field(0, description="Seed of the toy-task generator.")
    task_args: dict = Field(default_factory=dict, description="Extra keyword arguments for "
                                                              "raygraph.data.toy.write_toy_dataset.")


class DataConfig(Section):
    train_files: list[str] = Field(description="Training parquet file(s) in the verl-compatible schema; "
                                               "a single string is accepted.")
    train_weights: list[float] | None = Field(
        None, description="Mix the training files in these proportions, one weight > 0 per file of "
        "data.train_files (normalised; each file is reshuffled on its own epochs); null = every row of the "
        "files alike. data.format rl only.")
    val_files: list[str] = Field(default_factory=list, description="Validation parquet file(s); empty = no "
                                                                   "validation.")
    format: Literal["rl", "sft", "dpo"] = Field("rl", description="Row format: rl (prompt + ground truth), "
                                                                  "sft (prompt + response), dpo (chosen/rejected).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts drawn per training step; the step's batch is "
                                                       "prompts_per_step x rollout.n samples.")
    val_prompts: int | None = Field(None, ge=1, description="Use at most this many validation prompts; null = all.")
    max_prompt_length: int = Field(256, ge=1, description="Longest prompt in tokens (after the chat template).")
    overlong_prompt: Literal["drop", "error"] = Field(
        "drop", description="Prompts longer than max_prompt_length: drop them (counted warning) or fail. "
                            "Never truncated.")
    shuffle: bool = Field(True, description="Shuffle training prompts each epoch (seeded by trainer.seed).")
    apply_chat_template: bool = Field(True, description="Format prompts with the tokenizer's chat template.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables of the chat template, passed to the tokenizer's "
        "apply_chat_template (e.g. {enable_thinking: false} for Qwen3); needs apply_chat_template.")
    toy: ToyDataConfig | None = Field(None, description="If set and the data files are missing, generate the "
                                                        "toy task into the directory of data.train_files.")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value


class PoolConfig(Section):
    bundles: int = Field(ge=1, description="Bundles (one per worker) in this placement group.")
    cpus_per_bundle: float = Field(1.0, ge=0, description="CPUs in each bundle.")
    gpus_per_bundle: float = Field(0.0, ge=0, description="GPUs in each bundle.")
    strategy: Strategy = Field("PACK", description="Ray placement strategy across nodes.")


class PlacementConfig(Section):
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: every role shares the same devices, one rank per bundle; "
                                 "disaggregated: training and rollout run on separate devices.")
    train_workers: int = Field(1, ge=1, description="Data-parallel ranks of policy, critic and reference.")
    rollout_workers: int = Field(1, ge=1, description="Rollout engine replicas; unset = placement.train_workers "
                                                      "in colocated mode (one engine beside each rank), 1 in "
                                                      "disaggregated mode.")
    cpus_per_worker: float = Field(1.0, ge=0, description="CPUs per worker bundle (derived pools).")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs per worker bundle (derived pools); 0 = CPU.")
    strategy: Strategy = Field("PACK", description="Ray placement strategy of the derived pools.")
    pools: dict[str, PoolConfig] | None = Field(None, description="Explicit resource pools by name; null = "
                                                                  "derived from mode and the counts above.")
    roles: dict[str, str] = Field(default_factory=dict, description="Role -> pool name; required for "
                                                                    "every active role when pools is set.")
    placement_timeout_s: float = Field(60.0, gt=0, description="Give up if placement groups are not "
                                                               "ready in time.")
    weight_sync_timeout_s: float = Field(60.0, gt=0, description="Give up on a weight sync after this long.")
    weight_bucket_mb: int = Field(64, ge=1, description="Size of one weight-sync bucket.")
    weight_sync_verify: bool = Field(True, description="Disaggregated weight sync: the policy checksums "
                                                       "every bucket (XXH3-64 on CPU) and each rollout rank "
                                                       "refuses a bucket whose bytes do not match. false "
                                                       "skips both checksums (on CPU ~0.03 s per GB on "
                                                       "each side); syncs then report weights/verified = 0.")
    weight_sync_shared_memory: bool = Field(True, description="Disaggregated weight sync on CPU between "
                                                              "processes of one host: bucket bytes go "
                                                              "through /dev/shm and only their headers "
                                                              "over gloo (used when every receiver can "
                                                              "read the sender's segment; reported as "
                                                              "weights/via_shared_memory). false = every "
                                                              "byte over gloo.")
    max_staleness: int = Field(0, ge=0, description="Rollouts may lag the policy by this many versions "
                                                    "(async pipelining); 0 = synchronous, 1 = the next "
                                                    "step's rollouts are sampled during this step's update; "
                                                    "with rollout.streaming any k: no token trains more "
                                                    "than k versions behind the weights it updates.")

    @model_validator(mode="before")
    @classmethod
    def _rollout_workers_follow_train_workers(cls, data):
        """Colocated runs one engine per training rank: an unset rollout_workers is train_workers."""
        if isinstance(data, dict) and data.get("rollout_workers") is None \
                and data.get("mode", "colocated") == "colocated" and "train_workers" in data:
            data = {**data, "rollout_workers": data["train_workers"]}
        return data


class WarmStartConfig(Section):
    steps: int = Field(ge=1, description="SFT optimizer steps before RL starts.")
    lr: float = Field(1e-4, gt=0, description="SFT learning rate.")
    batch_size: int = Field(8, ge=1, description="SFT samples per optimizer step.")
    files: list[str] | None = Field(None, description="SFT data (prompt + ground-truth answer); "
                                                      "null = data.train_files.")

    @field_validator("files", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value


class TrainerConfig(Section):
    total_steps: int = Field(ge=1, description="Training steps (one batch of prompts each).")
    seed: int = Field(0, description="Seed of sampling, data order and initialisation.")
    output_dir: str = Field("runs", description="Runs go to <output_dir>/<experiment>/<run_name>/.")
    resume: str = Field("auto", description="auto: resume the run's newest intact checkpoint if any; never; "
                                            "or a checkpoint directory. Only some settings may change on "
                                            "resume (docs/guarantees.md).")
    val_every: int = Field(0, ge=0, description="Validate every N steps; 0 = only at start and end.")
    val_before_train: bool = Field(True, description="Validate before step 1 (the baseline the end "
                                                     "validation is compared with); false skips it.")
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps (also at the last step, on a stop "
                                                  "signal and after a failure that left a finished step); 0 = "
                                                  "only then. A restarted run redoes at most N-1 steps.")
    dump_rollouts: int = Field(10, ge=0, description="Write the step's rollouts (prompt, response, score and "
                                                     "reward extras, advantage, uid, weight version) to "
                                                     "<run>/samples/train_step_<N>.jsonl and MLflow every N "
                                                     "steps; 0 = never. Validation generations are always "
                                                     "written (val_step_<N>.jsonl).")
    dump_rows: int | None = Field(None, ge=1, description="Rows per sample dump (training and validation); "
                                                          "null = all.")
    executor: Literal["compiled", "interpreted"] = Field(
        "interpreted", description="Run the workflow DAG interpreted (default: Ray tasks in dependency "
        "order) or as a Ray compiled graph (lower per-step latency, but its readers busy-wait: on "
        "few CPU cores that steals compute; see docs/benchmarks.md).")
    profile: bool = Field(False, description="Record per-stage timings and a trace.")
    ray_address: str | None = Field(None, description="Ray cluster to join; null = start a local Ray.")
    stop_timeout_s: float = Field(60.0, gt=0, description="After a stop signal (ray job stop, Ctrl-C): time "
                                  "allowed to finish the step and write a checkpoint before exiting.")
    max_restarts: int = Field(3, ge=0, description="Recoveries of the run after an actor or node died, a stage "
                                                   "timed out or a weight sync failed: roles rebuilt, newest "
                                                   "checkpoint loaded, same data order (docs/fault-tolerance.md); "
                                                   "0 = fail at the first such fault.")
    step_timeout_s: float | None = Field(3600.0, gt=0, description="Watchdog: a training step (every stage of the "
                                                                   "graph) not done in this many seconds fails, "
                                                                   "naming the stage still running, and is "
                                                                   "recovered; null = no bound.")
    warm_start: WarmStartConfig | None = Field(None, description="Optional SFT stage before RL.")


class LoggingConfig(Section):
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI; null = a local store "
                                                              "under trainer.output_dir.")
    mlflow: bool = Field(True, description="Log params and metrics to MLflow.")
    console: Literal["auto", "bar", "lines"] = Field("auto", description="Progress bar, one line per "
                                                                         "step, or auto (bar on a TTY).")
    log_every: int = Field(1, ge=1, description="Print the console line and send metrics to MLflow and Ray "
                                                "every N steps (and at validation steps and the last "
                                                "step); metrics.jsonl always has every step.")


class CheckpointConfig(Section):
    keep_last: int = Field(2, ge=0, description="Keep the newest N checkpoints; 0 = keep all.")
    save_hf: bool = Field(True, description="Also save the policy as a HF model (save_pretrained).")


class RaygraphConfig(Section):
    """A whole run. Build it with `raygraph.config.load_config` or `build_config`, which also run the
    cross-field and registry checks that constructing this model alone does not."""

    experiment: str = Field("raygraph", description="Experiment name (MLflow experiment, run directory).")
    run_name: str | None = Field(None, description="Run name; null = $RAYGRAPH_RUN_NAME, else slurm-<job id> under "
                                                   "Slurm (a rerun of the job resumes it), else a timestamp.")
    workflow: str = Field("grpo", description="Workflow by registry name (workflows/<name>.py) or path "
                                              "(my_algo.py:build).")
    workflow_args: dict[str, Any] = Field(
        default_factory=dict, description="Arguments of the workflow, checked against what it declares (the "
        "keyword-only arguments of its build function, or its ARGS model); recorded with their defaults.")
    plugins: list[str] = Field(default_factory=list, description="User code imported before the config is "
                               "checked and in every process of the run: .py files (relative to the working "
                               "directory) or module names. They register losses, estimators and rewards "
                               "(raygraph.register_policy_loss, ...); see docs/custom-algorithm.md.")
    model: ModelConfig = Field(description="Policy model and how to load it.")
    data: DataConfig = Field(description="Datasets and prompt handling.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Response generation.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy training.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (used by "
                                                                          "critic-based estimators).")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="Reference model.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward computation.")
    extra_roles: dict[str, ExtraRoleConfig] = Field(
        default_factory=dict, description="Roles a workflow binds beyond the built-in ones (its ROLES), "
        "each a frozen model of its own, e.g. a distillation teacher (docs/custom-algorithm.md).")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and KL.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Resources and pools.")
    trainer: TrainerConfig = Field(description="The training loop.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and progress.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")

    @model_validator(mode="before")
    @classmethod
    def _tiny_model_path(cls, data):
        """model.tiny names its model: an unset model.path is `tiny_model_dir(trainer.output_dir, tiny)`.
        (A model.path given beside model.tiny is compared with it in `raygraph.config.checks`.)"""
        if not isinstance(data, dict):
            return data
        model, trainer = data.get("model"), data.get("trainer")
        tiny, path = (model.tiny, model.path) if isinstance(model, ModelConfig) else \
            (model.get("tiny"), model.get("path")) if isinstance(model, dict) else (None, None)
        if not isinstance(tiny, str) or path is not None:
            return data
        output_dir = trainer.output_dir if isinstance(trainer, TrainerConfig) else \
            trainer.get("output_dir") if isinstance(trainer, dict) else None
        if not isinstance(output_dir, str):
            output_dir = TrainerConfig.model_fields["output_dir"].default
        path = tiny_model_dir(output_dir, tiny)
        model = model.model_copy(update={"path": path}) if isinstance(model, ModelConfig) else {**model, "path": path}
        return {**data, "model": model}

    @field_validator("plugins", mode="before")
    @classmethod
    def _plugins(cls, value):
        value = [value] if isinstance(value, str) else value
        return [absolute_ref(v) if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    @field_validator("experiment", "run_name")
    @classmethod
    def _a_single_path_component(cls, value: str | None) -> str | None:
        if value is not None and (not value or value in (".", "..") or "/" in value or "\\" in value):
            raise ValueError("must be a plain name (no '/', '\\', '.' or '..'): it names a directory under "
                             "trainer.output_dir and must not point outside it")
        return value

    @property
    def samples_per_step(self) -> int:
        """Samples in one step's batch: data.prompts_per_step x rollout.n."""
        return self.data.prompts_per_step * self.rollout.n

    @property
    def resolved_rollout_engine(self) -> str:
        """rollout.engine, resolved: "hf" or "vllm" (see the key's description for auto)."""
        if self.rollout.engine != "auto":
            return self.rollout.engine
        from raygraph.config.engine_choice import auto_engine

        return auto_engine(self)[0]

    @property
    def rollout_context(self) -> int:
        """Tokens one rollout request may hold (the vLLM engine's `max_model_len`): rollout.max_model_len,
        else the longest the run can send (prompt + response, or an agent's max_total_tokens)."""
        r, prompt = self.rollout, self.data.max_prompt_length
        if r.max_model_len is not None:
            return r.max_model_len
        return r.agent.total_tokens(prompt, r.max_new_tokens) if r.agent is not None else prompt + r.max_new_tokens

    @property
    def uses_critic(self) -> bool:
        """True when the advantage estimator needs a value model (declared with the estimator)."""
        return "values" in estimator_needs(self.algorithm.advantage)

    @property
    def uses_kl(self) -> bool:
        """True when a KL term (loss or reward penalty) is active."""
        return self.actor.kl_loss_coef > 0 or self.algorithm.kl_in_reward.coef > 0

    @property
    def old_logprobs_source(self) -> str:
        """actor.old_logprobs, resolved: "recompute", "rollout", or "update" (the update's own
        detached log-probs; auto picks it when the update is one on-policy optimizer step)."""
        if self.actor.old_logprobs != "auto":
            return self.actor.old_logprobs
        if self.algorithm.rollout_correction.mode != "off":
            return "recompute"   # the correction compares the trainer's log-probs with the rollout's
        one_step = (self.actor.ppo_epochs == 1 and self.placement.max_staleness == 0
                    and self.actor.mini_batch_size in (None, self.samples_per_step)
                    and self.algorithm.kl_in_reward.coef == 0)
        return "update" if one_step else "recompute"

    @property
    def reference_from_policy(self) -> bool:
        """With model.lora the reference log-probs come from the policy's own model with its adapter
        disabled (the frozen base IS the reference): no reference role is started."""
        return self.model.lora is not None and self.reference.model_path in (None, self.model.path)

    @property
    def uses_reference(self) -> bool:
        """reference.enabled, resolved: auto = on when a KL term is used."""
        if self.reference.enabled is not None:
            return self.reference.enabled
        return self.uses_kl
