"""DAG fragments that the policy-gradient workflows share (they read the config; `steps` does not)."""

from __future__ import annotations

__all__ = ["rollout_columns"]


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
    if "reference" in roles.names():
        parts.append(roles.reference.bind("logprobs", rollouts))
    return parts
