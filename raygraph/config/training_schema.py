"""Config sections of what is trained and how: optimizers, actor, critic, reference, reward and
the algorithm's knobs. Part of the schema (`raygraph.config.schema` assembles the whole config);
every key is documented once, in its `Field(description=...)`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from raygraph.algos.user_code import absolute_ref
from raygraph.config.section import Section
from raygraph.rewards.judge import CODE_REF, DEFAULT_PARSER, DEFAULT_TEMPLATE

__all__ = ["OptimConfig", "ActorConfig", "CriticConfig", "ReferenceConfig", "RemoteRewardConfig", "RewardConfig", "RewardTermConfig",
           "KLInRewardConfig", "RolloutCorrectionConfig", "AlgorithmConfig", "LoraConfig", "ExtraRoleConfig"]


class LoraConfig(Section):
    rank: int = Field(ge=1, description="LoRA rank r of every adapter (the update B A has rank <= r); must "
                                        "not exceed the smaller dimension of any targeted layer.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator: the update is (alpha / rank) B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on each adapter's input while training.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Layers that get adapters: all-linear (every linear layer but the output "
        "head) or module-name suffixes such as [q_proj, v_proj]; each must name at least one nn.Linear.")


CRITIC_LR = 1e-5   # a value head starts untrained: it learns faster than the policy


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from 0 to lr.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate schedule after "
                                                                            "warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: final lr as a fraction of lr.")


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Policy optimizer.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's batch.")
    mini_batch_size: int | None = Field(None, ge=1, description="Samples per optimizer step (global, all "
                                                                "ranks); null = the whole batch.")
    micro_batch_size: int = Field(16, ge=1, description="Samples per forward/backward on one rank "
                                                        "(gradient accumulation).")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="Token-budget micro-batches for the policy and reference passes: also cap "
        "each forward/backward at this many tokens (rows x (longest prompt + longest response), padding "
        "trimmed); the gradient equals that of fixed-size micro-batches. null = rows only.")
    policy_loss: str = Field("ppo", description="Policy loss by registry name (raygraph.algos.losses, or one "
                                                "a plugin registers) or as my_code.py:my_loss.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip: ratio lower bound is 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="PPO clip: ratio upper bound is 1 + clip_high "
                                                    "(DAPO clip-higher when > clip_low).")
    dual_clip: float = Field(3.0, description="Dual-clip constant c > 1 bounding the loss of negative-"
                                              "advantage tokens (Ye et al. 2020).")
    loss_agg: str = Field("token-mean", description="How token losses are reduced to one number, by name "
                                                    "(raygraph.algos.losses.AGG_MODES).")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    kl_loss_coef: float = Field(0.0, ge=0, description="Weight of the KL(policy || reference) loss term; "
                                                       "0 = off.")
    kl_loss_kind: str = Field("k3", description="KL estimator of the loss term by registry name "
                                                "(raygraph.algos.kl, or one a plugin registers) or as "
                                                "my_code.py:my_kl; a trailing + = straight-through.")
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        "auto", description="Where the PPO ratio's old log-probs come from. recompute: a policy.logprobs "
                            "pass before the update. rollout: the rollout engine's own log-probs (no extra "
                            "pass; synchronous only; exact up to numerics when rollout and policy compute "
                            "in the same precision, see rollout/logprob_diff_max). auto: no extra pass when "
                            "the update is one on-policy optimizer step (ppo_epochs=1, one mini-batch, "
                            "synchronous, no KL in the reward, no rollout correction; then old = the "
                            "policy's own detached log-probs, exactly), else recompute.")

    _user_code = field_validator("policy_loss", "kl_loss_kind")(lambda value: _code_path(value))

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip(cls, value: float) -> float:
        if value <= 1:
            raise ValueError("must be greater than 1: the dual-clip bound is c x advantage, and c <= 1 "
                             "would clip below the ordinary PPO clip")
        return value


class CriticConfig(Section):
    model_path: str | None = Field(None, description="Value model initialisation; null = model.path.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=CRITIC_LR), description="Critic optimizer "
                               f"(lr defaults to {CRITIC_LR}, also when only other optim keys are given).")
    grad_clip: float = Field(1.0, gt=0, description="Clip the critic's global gradient norm to this value.")
    ppo_epochs: int = Field(1, ge=1, description="Critic passes over each step's batch.")
    mini_batch_size: int | None = Field(None, ge=1, description="Samples per critic optimizer step; null = "
                                                                "the whole batch.")
    micro_batch_size: int = Field(16, ge=1, description="Samples per critic forward/backward on one rank.")
    max_tokens_per_micro_batch: int | None = Field(None, ge=1, description="Token budget of one critic "
                                                   "forward/backward (as actor.max_tokens_per_micro_batch).")
    value_clip: float = Field(0.5, gt=0, description="Clip new values to old values +- value_clip.")
    loss_agg: str = Field("token-mean", description="How token value losses are reduced, by name "
                                                    "(raygraph.algos.losses.AGG_MODES).")

    @field_validator("optim", mode="before")
    @classmethod
    def _critic_lr_unless_given(cls, value):
        # `critic.optim.weight_decay=0.1` alone must not drop the critic's lr to the policy's default
        return {"lr": CRITIC_LR, **value} if isinstance(value, dict) else value


class ReferenceConfig(Section):
    enabled: bool | None = Field(None, description="Run a frozen reference model; null = only when a KL "
                                                   "term is used.")
    model_path: str | None = Field(None, description="The reference model; null = model.path (the policy's "
                                                     "start). It must use the policy's tokenizer.")
    shard: bool = Field(False, description="FSDP-shard the reference over its ranks instead of a full copy "
                                           "on each (for a reference larger than one device).")


class ExtraRoleConfig(Section):
    """A role a workflow binds beyond the built-in ones (e.g. a distillation `teacher`): a frozen
    causal LM with its own model, whose `logprobs` method returns the column `<role>_logprobs`."""

    model_path: str = Field(description="The role's model (local directory or hub id); it must use the "
                                        "policy's tokenizer, since its log-probs are per policy token.")
    dtype: str | None = Field(None, description="Weights dtype; null = model.dtype.")
    workers: int | None = Field(None, ge=1, description="Ranks of the role (each scores a shard of the batch); "
                                                        "null = placement.train_workers.")
    shard: bool = Field(False, description="FSDP-shard the model over the role's ranks instead of a full "
                                           "copy on each (a model larger than one device).")
    micro_batch_size: int | None = Field(None, ge=1, description="Rows per forward pass; null = "
                                                                 "actor.micro_batch_size.")


class RemoteRewardConfig(Section):
    url: str = Field(description="HTTP endpoint that scores a batch of responses.")
    timeout_s: float = Field(30.0, gt=0, description="Total deadline of one request attempt (connect, send, "
                                                     "read the whole answer), in seconds.")
    max_retries: int = Field(3, ge=0, description="Retries of a failed request.")
    backoff_s: float = Field(1.0, ge=0, description="First retry delay; doubled on each retry.")
    auth_env: str | None = Field(None, description="Environment variable holding a bearer token, if any.")


class RewardTermConfig(Section):
    function: str = Field(description="A reward function by registry name or as my_code.py:my_reward.")
    weight: float = Field(1.0, description="Its weight in the sample's score (sum of weight x function).")
    name: str | None = Field(None, description="Its metric name, reward/<name>/mean; null = the registry name "
                                               "or the function's name in the file.")

    _user_code = field_validator("function")(lambda value: _code_path(value))


class JudgeConfig(Section):
    model_path: str = Field(description="The judge: a causal LM (Hugging Face directory or hub id), frozen.")
    template: str = Field(DEFAULT_TEMPLATE, description="The judge's prompt for one answer, with the fields "
                          "{question} (the prompt's last user message), {prompt} (as the policy saw it), {response} "
                          "(the answer; an episode's last model turn) and {ground_truth}.")
    template_format: Literal["python", "jinja"] = Field("python", description="python: str.format fields in "
                                                        "braces; jinja: a Jinja template ({{ response }}).")
    chat: bool = Field(True, description="Send the prompt as a user message through the judge's chat template "
                                         "(when it has one); false = the raw text.")
    parser: str = Field(DEFAULT_PARSER, description="How the judge's output becomes a number: a regular expression "
                        "(its first group that matched, else the match; default: the first number) or my_code.py:fn (text -> "
                        "number, or None when it cannot read one). No number = a parse failure (reward.on_error).")
    weight: float = Field(1.0, description="The judge's weight in the score: weight x judge + the weighted "
                                           "reward.functions, if any (metric reward/judge/mean: its mean verdict).")
    engine: Literal["hf", "vllm"] = Field("hf", description="What generates the verdicts: the HF sampler or a "
                                                            "vLLM engine (greedy, in the reward actor).")
    max_new_tokens: int = Field(16, ge=1, description="Longest verdict, in tokens.")
    max_model_len: int = Field(2048, ge=16, description="vllm: the engine's context; a judge prompt longer than "
                                                        "this minus max_new_tokens is a failed call (reward.on_error).")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm: the judge engine's share of GPU memory (CPU build: of host RAM, for "
        "its KV cache); null = 0.9 on GPU, 0.15 on CPU. Set it lower when the judge shares a device or host "
        "with a vLLM rollout engine.")

    _user_code = field_validator("parser")(lambda value: _code_path(value) if CODE_REF.fullmatch(value) else value)


class RewardConfig(Section):
    kind: Literal["rule", "model", "remote", "env", "judge"] = Field(
        "rule", description="rule functions, a reward model, a remote service, env: the rewards the "
        "environment of rollout.agent gave (summed per episode for acc: 1 when the return is > 0), or judge: "
        "an LLM's verdict on each answer (reward.judge), plus reward.functions if set.")
    judge: JudgeConfig | None = Field(None, description="judge: the model, its prompt and how its verdict is read.")
    function: str | None = Field(None, description="rule: reward function by registry name "
                                                   "(raygraph.rewards, or one a plugin registers) or as "
                                                   "my_code.py:my_reward; null = chosen by each row's data_source.")
    model_path: str | None = Field(None, description="model: the sequence-classification reward model.")
    remote: RemoteRewardConfig | None = Field(None, description="remote: the scoring service.")

    _user_code = field_validator("function")(lambda value: _code_path(value))
    on_non_finite: Literal["fail", "zero"] = Field(
        "fail", description="A NaN or Inf score (or extra): fail the step naming the reward and the sample's "
        "uid, or score the sample 0 and count it in reward/non_finite (share of rows), with a warning.")
    functions: list[RewardTermConfig] = Field(
        default_factory=list, description="rule: several reward functions instead of reward.function, e.g. "
        "[{function: toy_arith, weight: 1.0}, {function: my.py:format_bonus, weight: 0.2}]; score = sum of "
        "weight x function; each function's unweighted mean is logged as reward/<name>/mean.")
    workers: int = Field(0, ge=0, description="rule: processes in each reward actor's scoring pool; 0 = call "
                                              "the functions in the actor itself (no start-up cost, no timeout).")
    timeout_s: float | None = Field(None, gt=0, description="rule: seconds one call of a reward function on one "
                                                            "sample may run (needs reward.workers >= 1; the "
                                                            "hung worker process is killed); null = no limit.")
    on_error: Literal["fail", "zero"] = Field(
        "fail", description="rule: a reward call that raises, returns a non-number or times out: fail the step "
        "naming the function, the sample's uid and the cause, or score that function 0 for the sample and count "
        "it in reward/errors and reward/timeouts (failed calls per sample), with one warning per step.")


class KLInRewardConfig(Section):
    coef: float = Field(0.0, ge=0, description="Initial weight of the KL penalty subtracted from rewards; 0 = off.")
    kind: str = Field("k1", description="KL estimator by registry name (raygraph.algos.kl, or one a plugin "
                                        "registers) or as my_code.py:my_kl; a trailing + = straight-through.")

    _user_code = field_validator("kind")(lambda value: _code_path(value))
    controller: Literal["fixed", "adaptive"] = Field("fixed", description="Keep coef fixed or adapt it "
                                                                          "towards target_kl (Ziegler et al. 2019).")
    target_kl: float = Field(0.1, gt=0, description="adaptive: KL per sequence the controller aims for.")
    horizon: int = Field(10000, ge=1, description="adaptive: samples over which coef adapts.")


class RolloutCorrectionConfig(Section):
    mode: Literal["off", "truncated_is", "masked_is"] = Field(
        "off", description="Correct each token for the rollout engine's mismatch with the trainer, using "
        "r = pi_old / pi_rollout with pi_old recomputed by the trainer (a policy.logprobs pass): "
        "truncated_is weights its advantage by min(r, cap); masked_is drops tokens with r outside "
        "[1/cap, cap] from the loss. Metrics: rollout/mismatch_kl, rollout/correction_*.")
    cap: float = Field(2.0, gt=1.0, description="Truncation (truncated_is) or band (masked_is) of the ratio.")


class DynamicSamplingConfig(Section):
    enabled: bool = Field(False, description="DAPO dynamic sampling's filter (grpo workflow): after scoring, drop "
                                             "the groups whose samples all have the same `metric`, generate more "
                                             "(max_extra_rounds) until the batch is full; the update trains on "
                                             "what was kept (a batch still short shrinks, possibly to nothing: then "
                                             "no optimizer step, counted in actor/empty_updates). Metrics: "
                                             "rollout/groups_total, rollout/groups_kept, rollout/groups_filtered.")
    metric: str = Field("acc", description="What must vary within a group: a reward extra (`acc`, raw accuracy, "
                                           "the default) or `score` (the summed token-level score).")
    max_extra_rounds: int = Field(2, ge=0, le=16, description="Extra generation rounds per step while fewer than "
                                  "data.prompts_per_step groups are kept: each generates from the next "
                                  "prompts_per_step prompts of the data order (0 = filter only). Prompts of "
                                  "rounds a step did not need stay in the data order for the next step. "
                                  "Metrics: rollout/gen_rounds, reward/sampled_mean.")


class OverlongPenaltyConfig(Section):
    buffer: int = Field(0, ge=0, description="DAPO soft overlong punishment (grpo workflow): over the last `buffer` "
                                             "tokens before rollout.max_new_tokens the score falls linearly from 0 "
                                             "to -factor (0 = off). Metric: reward/overlong_penalty_mean.")
    factor: float = Field(1.0, ge=0, description="The penalty at rollout.max_new_tokens tokens.")


class AlgorithmConfig(Section):
    advantage: str | None = Field(None, description="Advantage estimator by registry name "
                                                      "(raygraph.algos.advantages), one of those the workflow "
                                                      "accepts (its ESTIMATORS); null = the workflow's default. "
                                                      "Workflows without advantages (sft, dpo) reject a value. "
                                                      "A user estimator (registered by a plugin, or "
                                                      "my_code.py:my_estimator) is accepted by any workflow "
                                                      "that provides the inputs it needs.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    norm_eps: float = Field(1e-6, gt=0, description="Added to the std when normalising advantages.")
    kl_in_reward: KLInRewardConfig = Field(default_factory=KLInRewardConfig,
                                           description="KL penalty folded into the reward.")
    dpo_beta: float = Field(0.1, gt=0, description="DPO: inverse temperature beta.")
    dpo_loss: str = Field("sigmoid", description="DPO loss variant by registry name (raygraph.algos.dpo, or "
                                                 "one a plugin registers) or as my_code.py:my_dpo_loss.")
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig,
                                                        description="Rollout-vs-trainer mismatch correction.")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig,
                                                    description="DAPO: filter groups with no spread.")
    overlong_penalty: OverlongPenaltyConfig = Field(default_factory=OverlongPenaltyConfig,
                                                    description="DAPO: soft penalty near the length limit.")
    mask_truncated: bool = Field(False, description="DAPO overlong filtering (grpo workflow): responses that reach "
                                                    "rollout.max_new_tokens get a zero response_mask (no loss); "
                                                    "they still count in their group's statistics. Metric: "
                                                    "rollout/truncated_rows.")

    _user_code = field_validator("advantage", "dpo_loss")(lambda value: _code_path(value))
    is_cap: float = Field(2.0, ge=1.0, description="Asynchronous pipelining (placement.max_staleness > 0): "
                                                   "each token of a stale rollout has its advantage weighted "
                                                   "by min(pi_old / pi_rollout, is_cap) (truncated IS).")


def _code_path(value):
    """A `file.py:fn` reference with its file made absolute (every actor then finds it)."""
    return absolute_ref(value) if isinstance(value, str) and ":" in value else value
