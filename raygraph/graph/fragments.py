"""Graph fragments that the policy-gradient workflows share (they read the config;
`raygraph.graph.whole_batch` does not)."""

from __future__ import annotations

from raygraph.graph import whole_batch
from raygraph.graph.nodes import InputNode, MultiOutputNode

__all__ = ["rollout_columns", "validation_graph"]


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


def validation_graph(roles, *, greedy: bool = True):
    """One sample per validation prompt (greedy, or sampled as in training), scored by the reward
    role: outputs `val/accuracy`, `val/reward/*` (`whole_batch.validation_metrics`)."""
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts, greedy=greedy, n=1)
        scored = roles.gather(rollouts, roles.reward.bind("score", rollouts))
        return MultiOutputNode([roles.apply(whole_batch.validation_metrics, scored)])
