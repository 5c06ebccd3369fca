"""Builders: turn the config into resource pools and role specs (flat worker arguments).

This is the only place that reads config sections to construct workers, so workers keep flat
keyword arguments and never see the config object.
"""

from __future__ import annotations

from raygraph.cluster import PoolSpec, RoleSpec
from raygraph.models.lora import LoraSpec
from raygraph.run.graphs import worker_classes

__all__ = ["optimizer_steps_per_batch", "role_specs", "pools_for", "colocation"]


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
    if cfg.rollout_engine == "vllm":
        return {**sampling, "gpu_memory_utilization": r.gpu_memory_utilization, "max_model_len": r.max_model_len,
                "tensor_parallel_size": r.tensor_parallel_size, "enforce_eager": r.enforce_eager,
                "enable_prefix_caching": r.enable_prefix_caching, "enable_sleep_mode": r.sleep_between_steps,
                **_lora_args(cfg)}
    hf = {"attn_impl": cfg.model.attn_impl, "micro_batch_size": r.micro_batch_size}
    return {**sampling, **hf, **({"lora": _lora(cfg)} if cfg.model.lora is not None else {})}


def _reward_args(cfg) -> dict:
    reward = cfg.reward
    tokenizer = cfg.model.tokenizer_path or cfg.model.path
    policy = {"on_non_finite": reward.on_non_finite}
    if reward.kind == "model":
        return {"model_path": reward.model_path, "policy_tokenizer_path": tokenizer, "dtype": cfg.model.dtype,
                **policy}
    if reward.kind == "remote":
        remote = reward.remote
        return {"url": remote.url, "tokenizer_path": tokenizer, "timeout_s": remote.timeout_s,
                "max_retries": remote.max_retries, "backoff_s": remote.backoff_s, "auth_env": remote.auth_env,
                **policy}
    return {"tokenizer_path": tokenizer, "function": reward.function, **policy,
            "functions": [t.model_dump() for t in reward.functions], "workers": reward.workers,
            "timeout_s": reward.timeout_s, "on_error": reward.on_error, "plugins": tuple(cfg.plugins)}


def role_specs(cfg, role_names: tuple[str, ...]) -> dict[str, RoleSpec]:
    """RoleSpecs for the roles a workflow binds (plus the reference when a KL term is used)."""
    colocated = cfg.placement.mode == "colocated"
    train_world = cfg.placement.train_workers
    rollout_world = train_world if colocated else cfg.placement.rollout_workers
    train_pool, rollout_pool = ("main", "main") if colocated else ("train", "rollout")
    layout = {  # role -> (worker arguments, ranks, pool, torch.distributed group)
        "policy": (_policy_args, train_world, train_pool, True),
        "critic": (_critic_args, train_world, train_pool, True),
        # a frozen model needs a torch.distributed group only to be sharded: unsharded, its actor
        # (when not fused with the policy's) can be restarted alone (stage-level recovery)
        "reference": (_reference_args, train_world, train_pool, cfg.reference.shard),
        "rollout": (_rollout_args, rollout_world, rollout_pool, False),
        "reward": (_reward_args, rollout_world, rollout_pool, False),
    }
    for role, extra in cfg.extra_roles.items():   # a workflow's own frozen models, placed like the reference
        layout[role] = (lambda c, r=role: _extra_role_args(c, r), extra.workers or train_world, train_pool,
                        extra.shard)
    mapping = cfg.placement.roles if cfg.placement.pools else {}
    specs = {}
    for name, cls in worker_classes(cfg, role_names).items():
        args, world, pool, distributed = layout[name]
        specs[name] = RoleSpec(cls, args(cfg), world, mapping.get(name, pool), distributed=distributed)
    if cfg.model.lora is not None and "rollout" in specs:
        print(f"[raygraph] {_lora_sync(cfg)[1]}", flush=True)   # the sync mode, said once
    return specs


def pools_for(cfg) -> dict[str, PoolSpec]:
    """Resource pools: one shared pool when colocated, train + rollout pools when disaggregated."""
    p = cfg.placement
    if p.pools:
        return {name: PoolSpec(pool.bundles, pool.cpus_per_bundle, pool.gpus_per_bundle, pool.strategy)
                for name, pool in p.pools.items()}
    if p.mode == "colocated":
        return {"main": PoolSpec(p.train_workers, p.cpus_per_worker, p.gpus_per_worker, p.strategy)}
    return {"train": PoolSpec(p.train_workers, p.cpus_per_worker, p.gpus_per_worker, p.strategy),
            "rollout": PoolSpec(p.rollout_workers, p.cpus_per_worker, p.gpus_per_worker, p.strategy)}


def colocation(cfg, specs: dict[str, RoleSpec]) -> list[tuple[str, ...]]:
    """Which roles share one actor process per rank: those of a group placed alike (same pool and
    ranks as the group's first); a role given its own pool (`placement.roles`) has its own actors."""
    extra = tuple(cfg.extra_roles)   # fused with the policy's ranks when placed like them
    if cfg.placement.mode == "colocated":
        groups = [("policy", "rollout", "reference", "critic", "reward", *extra)]
    else:
        groups = [("policy", "reference", "critic", *extra), ("rollout", "reward")]
    units = []
    for group in groups:
        members = [r for r in group if r in specs]
        if members:
            first = specs[members[0]]
            members = [r for r in members if (specs[r].pool, specs[r].world_size) == (first.pool, first.world_size)]
        if len(members) > 1:
            units.append(tuple(members))
    return units
