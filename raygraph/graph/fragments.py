"""Graph fragments that the policy-gradient workflows share (they read the config;
`raygraph.graph.whole_batch` does not)."""

from __future__ import annotations

from raygraph.batch import without_extra_prompts
from raygraph.graph import corrections, dapo, step_metrics, whole_batch
from raygraph.graph.nodes import InputNode, MultiOutputNode

__all__ = ["advantages", "first_round_prompts", "reference_logprobs", "rollout_columns", "shape_rollouts",
           "validation_graph", "update_batch"]


def rollout_columns(roles, cfg, rollouts) -> list:
    """What a policy-gradient step computes from its rollouts before the advantages.

    Reward scores; old log-probs from a `policy.logprobs` pass only when `actor.old_logprobs`
    resolves to "recompute" (with "rollout" `compute_advantages(old_from_rollout=True)` copies the
    rollout's, with "update" the policy update uses its own, see `RaygraphConfig.old_logprobs_source`);
    reference log-probs when a reference role runs. Gather them with the rollouts.
    """
    parts = [roles.reward.bind("score", rollouts)]
    if cfg.old_logprobs_source == "recompute":
        parts.append(roles.policy.bind("logprobs", rollouts))
    if cfg.uses_reference or "reference" in roles.names():
        parts.append(reference_logprobs(roles, cfg, rollouts))
    return parts


def first_round_prompts(roles, cfg, prompts):
    """What the step's first `rollout.generate` samples from: `prompts` without the extra prompt
    batches the driver attaches when the graph reads some (`raygraph.batch.EXTRA_PROMPTS`)."""
    sampling = cfg.algorithm.dynamic_sampling   # shape_rollouts reads extra batches exactly then
    return roles.apply(without_extra_prompts, prompts) if sampling.enabled and sampling.max_extra_rounds else prompts


def advantages(roles, cfg, batch, prompts):
    """The node computing `advantages` and `returns` of the gathered `batch` with the config's
    estimator (`algorithm.advantage`) and its settings (`whole_batch.compute_advantages`): every
    policy-gradient workflow reads the config here, once."""
    algo = cfg.algorithm
    return roles.apply(whole_batch.compute_advantages, batch, prompts, estimator=algo.advantage,
                       gamma=algo.gamma, lam=algo.lam, eps=algo.norm_eps, kl_kind=algo.kl_in_reward.kind,
                       old_from_rollout=cfg.old_logprobs_source == "rollout")


def shape_rollouts(roles, cfg, scored, prompts=None):
    """DAPO's shaping of the scored rollouts, each step only when configured (`raygraph.graph.dapo`):
    the overlong penalty (`algorithm.overlong_penalty.buffer` > 0), the truncation mask
    (`algorithm.mask_truncated`), then the group filter (`algorithm.dynamic_sampling.enabled`),
    after which the batch may be smaller than the step's, or empty. With
    `dynamic_sampling.max_extra_rounds` > 0 (needs `prompts`, the step's InputNode), up to that
    many more rounds generate from the next prompt batches and are scored and shaped the same
    way until `data.prompts_per_step` groups are kept (`dapo.refill_prompts`, `dapo.add_round`).

    Returns:
        `(batch node, [metric nodes])`; no nodes at all when nothing is configured.
    """
    sampling = cfg.algorithm.dynamic_sampling
    batch = _penalise(roles, cfg, scored)
    if sampling.enabled:
        target = cfg.data.prompts_per_step
        batch = roles.apply(dapo.filter_groups, batch, metric=sampling.metric, max_groups=target)
        for k in range(1, sampling.max_extra_rounds + 1):
            if prompts is None:
                raise ValueError("dynamic_sampling.max_extra_rounds > 0: shape_rollouts needs the step's prompts")
            more = roles.rollout.bind("generate", roles.apply(dapo.refill_prompts, prompts, batch, round=k,
                                                              target=target))
            more = _penalise(roles, cfg, roles.gather(more, *rollout_columns(roles, cfg, more)))
            batch = roles.apply(dapo.add_round, batch, more, metric=sampling.metric, target=target)
    if batch is scored:
        return scored, []
    return batch, [roles.apply(dapo.shaping_metrics, batch)]


def _penalise(roles, cfg, scored):
    """The overlong penalty and the truncation mask, when configured (else `scored` itself)."""
    algo, max_len = cfg.algorithm, response_budget(cfg)
    batch = scored
    if algo.overlong_penalty.buffer:
        batch = roles.apply(dapo.overlong_penalty, batch, max_len=max_len, buffer=algo.overlong_penalty.buffer,
                            factor=algo.overlong_penalty.factor)
    if algo.mask_truncated:
        batch = roles.apply(dapo.mask_truncated, batch, max_len=max_len)
    return batch


def response_budget(cfg) -> int:
    """The model tokens one row may hold, what DAPO's length options measure against:
    `rollout.max_new_tokens`, or with multi-turn episodes `max_turns` x the tokens of a turn."""
    agent = cfg.rollout.agent
    return cfg.rollout.max_new_tokens if agent is None else agent.max_turns * agent.turn_tokens(cfg.rollout.max_new_tokens)


def reference_logprobs(roles, cfg, batch):
    """The node computing `ref_logprobs` of `batch`: the reference role's, or with `model.lora`
    the policy's own model with its adapter disabled (the frozen base is the reference, so no
    second copy of the model is started; `cfg.reference_from_policy`)."""
    if cfg.reference_from_policy:
        return roles.policy.bind("ref_logprobs", batch)
    return roles.reference.bind("logprobs", batch)


def update_batch(roles, cfg, batch):
    """The batch the policy update trains on, and the metric nodes that describe the correction.

    With `algorithm.rollout_correction.mode` set, every token is corrected for the rollout
    engine's mismatch with the trainer (`corrections.correct_rollouts`, which also covers stale
    rows); otherwise asynchronous pipelining (`placement.max_staleness > 0`) weights the stale
    rows' tokens by truncated IS (`corrections.truncated_importance_weights`); otherwise the batch
    is trained on as it is.

    Returns:
        `(batch node, [metric nodes])`; the metric nodes read the batch before the correction.
    """
    correction, pipelined = cfg.algorithm.rollout_correction, cfg.placement.max_staleness > 0
    metrics = [roles.apply(corrections.off_policy_metrics, batch, cap=cfg.algorithm.is_cap)] if pipelined else []
    if correction.mode != "off":
        metrics.append(roles.apply(corrections.rollout_correction_metrics, batch, mode=correction.mode,
                                   cap=correction.cap))
        return roles.apply(corrections.correct_rollouts, batch, mode=correction.mode, cap=correction.cap), metrics
    if pipelined:
        return roles.apply(corrections.truncated_importance_weights, batch, cap=cfg.algorithm.is_cap), metrics
    return batch, metrics


def validation_graph(roles, *, greedy: bool = True, n: int = 1, temperature: float = 1.0):
    """Validation, scored by the reward role.

    One sample per prompt (greedy, or sampled as in training): `val/accuracy`, `val/reward/*`
    (`step_metrics.validation_metrics`). With `n > 1`, also `n` samples per prompt at
    `temperature`: `val/pass@k`, `val/maj@n` (`step_metrics.sampled_validation_metrics`).
    """
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts, greedy=greedy, n=1)
        scored = roles.gather(rollouts, roles.reward.bind("score", rollouts))
        outputs = [roles.apply(step_metrics.validation_metrics, scored)]
        if n > 1:
            samples = roles.rollout.bind("generate", prompts, n=n, temperature=temperature)
            sampled = roles.gather(samples, roles.reward.bind("score", samples))
            outputs.append(roles.apply(step_metrics.sampled_validation_metrics, sampled, n=n))
        return MultiOutputNode(outputs)
