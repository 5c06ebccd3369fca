"""Builders: turn the config into resource pools and role specs (flat worker arguments).

This is the only place that reads config sections to construct workers, so workers keep flat
keyword arguments and never see the config object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raygraph.cluster import PoolSpec, RoleSpec
from raygraph.config.role_kinds import kind_of, weight_sync_pairs
from raygraph.models.lora import LoraSpec
from raygraph.run.graphs import worker_classes

__all__ = ["optimizer_steps_per_batch", "role_specs", "WORKER_ARGS", "PlacementPlan", "placement_plan", "pools_for"]


def optimizer_steps_per_batch(cfg, section) -> int:
    mini = section.mini_batch_size or cfg.samples_per_step
    return section.ppo_epochs * max(1, cfg.samples_per_step // mini)


def _per_rank(global_size: int | None, world: int) -> int | None:
    return None if global_size is None else max(1, global_size // world)


def _model_args(cfg) -> dict:
    return {"model_path": cfg.model.path, "dtype": cfg.model.dtype, "attn_impl": cfg.model.attn_impl}


def _optim_args(cfg, section) -> dict:
    optim = section.optim
    return {
        "lr": optim.lr, "weight_decay": optim.weight_decay, "betas": tuple(optim.betas),
        "warmup_steps": optim.warmup_steps, "lr_schedule": optim.schedule,
        "min_lr_ratio": optim.min_lr_ratio, "grad_clip": section.grad_clip,
        "total_steps": cfg.trainer.total_steps * optimizer_steps_per_batch(cfg, section),
        "ppo_epochs": section.ppo_epochs, "micro_batch_size": section.micro_batch_size,
        "max_tokens_per_micro_batch": section.max_tokens_per_micro_batch,
        "mini_batch_size": _per_rank(section.mini_batch_size, cfg.placement.train_workers),
    }


def _lora(cfg) -> LoraSpec | None:
    lora = cfg.model.lora
    if lora is None:
        return None
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=targets)


def _lora_sync(cfg) -> tuple[str, str]:
    """What the policy's weight syncs send with LoRA, as the rollout worker class decides, and why."""
    rollout_cls = worker_classes(cfg, ("rollout",))["rollout"]
    return rollout_cls.lora_sync_for(cfg.model.path, _lora(cfg))


def _lora_args(cfg) -> dict:
    """The policy's LoRA and what its weight syncs send (the policy and the rollout get the same)."""
    if cfg.model.lora is None:
        return {}
    return {"lora": _lora(cfg), "lora_sync": _lora_sync(cfg)[0]}


def _policy_args(cfg) -> dict:
    actor = cfg.actor
    return {**_lora_args(cfg),
        **_model_args(cfg), **_optim_args(cfg, actor),
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "policy_loss": actor.policy_loss, "clip_low": actor.clip_low, "clip_high": actor.clip_high,
        "dual_clip": actor.dual_clip, "loss_agg": actor.loss_agg, "entropy_coef": actor.entropy_coef,
        "kl_loss_coef": actor.kl_loss_coef, "kl_loss_kind": actor.kl_loss_kind,
        "temperature": cfg.rollout.temperature, "seed": cfg.trainer.seed,
    }


def _critic_args(cfg) -> dict:
    critic = cfg.critic
    args = {**_model_args(cfg), **_optim_args(cfg, critic), "value_clip": critic.value_clip,
            "loss_agg": critic.loss_agg, "seed": cfg.trainer.seed}
    args["model_path"] = critic.model_path or cfg.model.path
    return args


def _frozen_args(cfg, model_path: str, dtype: str, micro_batch_size: int, shard: bool) -> dict:
    return {"model_path": model_path, "dtype": dtype, "attn_impl": cfg.model.attn_impl, "shard": shard,
            "micro_batch_size": micro_batch_size, "max_tokens_per_micro_batch": cfg.actor.max_tokens_per_micro_batch,
            "temperature": cfg.rollout.temperature}


def _reference_args(cfg) -> dict:
    ref = cfg.reference
    return _frozen_args(cfg, ref.model_path or cfg.model.path, cfg.model.dtype, cfg.actor.micro_batch_size, ref.shard)


def _extra_role_args(cfg, role: str) -> dict:
    """A workflow's own frozen role (`extra_roles.<role>`): its model, output column `<role>_logprobs`."""
    extra = cfg.extra_roles[role]
    return {**_frozen_args(cfg, extra.model_path, extra.dtype or cfg.model.dtype,
                           extra.micro_batch_size or cfg.actor.micro_batch_size, extra.shard),
            "column": f"{role}_logprobs"}


def _rollout_args(cfg) -> dict:
    r = cfg.rollout
    sampling = {"model_path": cfg.model.path, "dtype": cfg.model.dtype, "seed": cfg.trainer.seed, "n": r.n,
                "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k, "stop_token_ids": tuple(r.stop_token_ids)}
    if r.agent is not None:
        sampling["agent"] = _agent_args(cfg)
    if cfg.resolved_rollout_engine == "vllm":
        return {**sampling, "gpu_memory_utilization": r.gpu_memory_utilization,
                "max_model_len": cfg.rollout_context,
                "tensor_parallel_size": r.tensor_parallel_size, "enforce_eager": r.enforce_eager,
                "enable_prefix_caching": r.enable_prefix_caching, "enable_sleep_mode": r.sleep_between_steps,
                "engine_core": r.vllm_engine_core, "partial_rollouts": r.partial_rollouts,
                **_lora_args(cfg)}
    hf = {"attn_impl": cfg.model.attn_impl, "micro_batch_size": r.micro_batch_size,
          "partial_rollouts": r.partial_rollouts}
    return {**sampling, **hf, **({"lora": _lora(cfg)} if cfg.model.lora is not None else {})}


def _agent_args(cfg) -> dict:
    """The `AgentLoop` arguments of `rollout.agent` (the engine adds its tokenizer and stop ids)."""
    a, r = cfg.rollout.agent, cfg.rollout
    budgets = {"max_turns": a.max_turns, "max_new_tokens": a.turn_tokens(r.max_new_tokens),
               "max_total_tokens": a.total_tokens(cfg.data.max_prompt_length, r.max_new_tokens),
               "max_message_tokens": a.max_message_tokens}
    return {"budgets": budgets, "env": a.env, "env_args": dict(a.env_args), "tools": list(a.tools),
            "tool_parser": a.tool_parser, "tool_timeout_s": a.tool_timeout_s, "env_timeout_s": a.env_timeout_s,
            "env_workers": a.env_workers, "tool_role": a.tool_role, "env_hosts": a.env_hosts,
            "env_host_cpus": a.env_host_cpus, "plugins": tuple(cfg.plugins),
            "chat_template_kwargs": dict(cfg.data.chat_template_kwargs),
            "groups_in_flight": a.groups_in_flight if a.dispatch == "least_loaded" else None,
            **({"program": a.program, "program_args": dict(a.program_args), "program_timeout_s": a.program_timeout_s,
                "host": a.program_host, "temperature": r.temperature, "top_p": r.top_p} if a.program else {})}


def _reward_args(cfg) -> dict:
    reward = cfg.reward
    tokenizer = cfg.model.tokenizer_path or cfg.model.path
    policy = {"on_non_finite": reward.on_non_finite}
    if reward.kind == "model":
        return {"model_path": reward.model_path, "policy_tokenizer_path": tokenizer, "dtype": cfg.model.dtype,
                **policy}
    if reward.kind == "env":
        return {}
    if reward.kind == "remote":
        remote = reward.remote
        return {"url": remote.url, "tokenizer_path": tokenizer, "timeout_s": remote.timeout_s,
                "max_retries": remote.max_retries, "backoff_s": remote.backoff_s, "auth_env": remote.auth_env,
                **policy}
    rules = {"functions": [t.model_dump() for t in reward.functions], "workers": reward.workers,
             "timeout_s": reward.timeout_s, "on_error": reward.on_error, "plugins": tuple(cfg.plugins)}
    if reward.kind == "judge":
        judge = reward.judge
        return {"model_path": judge.model_path, "template": judge.template, "template_format": judge.template_format,
                "chat": judge.chat, "parser": judge.parser, "weight": judge.weight, "engine": judge.engine,
                "max_new_tokens": judge.max_new_tokens, "max_model_len": judge.max_model_len,
                "gpu_memory_utilization": judge.gpu_memory_utilization, "tokenizer_path": tokenizer,
                "dtype": cfg.model.dtype, **rules, **policy}
    return {"tokenizer_path": tokenizer, "function": reward.function, **policy, **rules}


# Role kind (`raygraph.config.role_kinds`) -> its worker's constructor arguments, from (config, role name).
WORKER_ARGS: dict[str, Callable[[Any, str], dict]] = {
    "policy": lambda cfg, role: _policy_args(cfg),
    "rollout": lambda cfg, role: _rollout_args(cfg),
    "reference": lambda cfg, role: _reference_args(cfg),
    "critic": lambda cfg, role: _critic_args(cfg),
    "reward": lambda cfg, role: _reward_args(cfg),
    "extra": _extra_role_args,
}


@dataclass(frozen=True)
class PlacementPlan:
    """Where a run's roles go, decided once from the config (`placement_plan`): role_specs,
    `start_ray` (how many CPUs) and `build_roles` (pools, fused actors, weight syncs) read it.

    Attributes:
        pools: pool name -> `PoolSpec`.
        roles: role -> (its pool, its number of ranks).
        fused: tuples of roles whose rank i shares one actor process.
        weight_sync: (src, dst) role pairs whose weights are synced after each update.
    """

    pools: dict[str, PoolSpec]
    roles: dict[str, tuple[str, int]]
    fused: tuple[tuple[str, ...], ...]
    weight_sync: tuple[tuple[str, str], ...]

    def weights_move(self, src: str, dst: str) -> str:
        """How the weights of a synced pair move: "in_process" between fused roles (one actor holds
        both), else "collective" (a bucketed broadcast over a collective group)."""
        return "in_process" if any(src in unit and dst in unit for unit in self.fused) else "collective"


def placement_plan(cfg, role_names: tuple[str, ...]) -> PlacementPlan:
    """The placement of the roles a workflow binds (`worker_classes`): each role on its side's
    pool and ranks (`RoleKind.side`; colocated: one shared pool, one rank per training rank),
    or on the pool `placement.roles` names; roles of one side placed alike fuse into one actor
    per rank (colocated: every such role), and the weight-sync pairs among them."""
    p = cfg.placement
    colocated = p.mode == "colocated"
    side_pool = {"train": "main", "rollout": "main"} if colocated else {"train": "train", "rollout": "rollout"}
    side_ranks = {"train": p.train_workers, "rollout": p.train_workers if colocated else p.rollout_workers}
    mapping = p.roles if p.pools else {}
    names = tuple(worker_classes(cfg, role_names))
    roles = {}
    for name in names:
        side, extra = kind_of(name).side, cfg.extra_roles.get(name)
        ranks = extra.workers if extra is not None and extra.workers else side_ranks[side]
        roles[name] = (mapping.get(name, side_pool[side]), ranks)
    return PlacementPlan(pools_for(cfg), roles, _fused(names, roles, side_pool), weight_sync_pairs(names))


def _fused(names: tuple[str, ...], roles: dict[str, tuple[str, int]], side_pool: dict[str, str]):
    """Per default pool (one colocated, one per side disaggregated), the roles placed like its
    first role: one actor process per rank. A role given its own pool (`placement.roles`) or
    other ranks has actors of its own."""
    units = []
    for pool in dict.fromkeys(side_pool.values()):
        group = [r for r in names if side_pool[kind_of(r).side] == pool]
        alike = tuple(r for r in group if roles[r] == roles[group[0]])
        if len(alike) > 1:
            units.append(alike)
    return tuple(units)


def role_specs(cfg, role_names: tuple[str, ...]) -> dict[str, RoleSpec]:
    """RoleSpecs for the roles a workflow binds (plus the reference when a KL term is used), on
    the pools and ranks of `placement_plan`. Trained roles run in a torch.distributed group; a
    frozen model joins one only when sharded (`shard`): unsharded, its actor (when not fused
    with the policy's) can be restarted alone (stage-level recovery)."""
    plan = placement_plan(cfg, role_names)
    specs = {}
    for name, cls in worker_classes(cfg, role_names).items():
        kind = kind_of(name)
        args = WORKER_ARGS[kind.name](cfg, name)
        pool, ranks = plan.roles[name]
        specs[name] = RoleSpec(cls, args, ranks, pool, distributed=kind.trained or args.get("shard", False))
    if cfg.model.lora is not None and "rollout" in specs:
        print(f"[raygraph] {_lora_sync(cfg)[1]}", flush=True)   # the sync mode, said once
    return specs


def pools_for(cfg) -> dict[str, PoolSpec]:
    """The plan's resource pools: `placement.pools`, else one shared pool when colocated, train +
    rollout pools when disaggregated."""
    p = cfg.placement
    if p.pools:
        return {name: PoolSpec(pool.bundles, pool.cpus_per_bundle, pool.gpus_per_bundle, pool.strategy)
                for name, pool in p.pools.items()}
    if p.mode == "colocated":
        return {"main": PoolSpec(p.train_workers, p.cpus_per_worker, p.gpus_per_worker, p.strategy)}
    return {"train": PoolSpec(p.train_workers, p.cpus_per_worker, p.gpus_per_worker, p.strategy),
            "rollout": PoolSpec(p.rollout_workers, p.cpus_per_worker, p.gpus_per_worker, p.strategy)}
