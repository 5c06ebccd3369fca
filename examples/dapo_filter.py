"""GRPO with DAPO's group filter, written as a user workflow (Yu et al. 2025, "DAPO", sec. 3.2).

One step::

    prompts ─► rollout.generate (n samples) ─┬─► reward.score
                                              └─► policy.logprobs (only with actor.old_logprobs=recompute)
    gather ─► keep the groups whose `metric` varies ─► advantages (kept groups) ─► policy.update ─► sync

A group whose samples are all right (or all wrong) has zero group-relative advantage: it gives no
gradient, yet its tokens would count in the loss normaliser and dilute the others'. Dropping it
makes the batch smaller, or empty: the update splits the kept groups over the training ranks
(whole groups, as evenly as they allow) and makes no optimizer step on an empty batch
(`actor/empty_updates`). This file keeps the filter alone: no further prompts are sampled to
refill the batch.

The shipped `grpo` workflow does the same with `algorithm.dynamic_sampling.enabled=true`, and
also refills the batch as the paper does, with up to `max_extra_rounds` more generation rounds
from the next prompts of the data order (`raygraph.graph.fragments.shape_rollouts` shows that
loop: `dapo.refill_prompts` and `dapo.add_round`); this file shows the pieces. Use it with
`workflow: examples/dapo_filter.py:build` in any RL config, and
`workflow_args.metric=score` to filter on the summed score instead of the reward's `acc`.
"""

from __future__ import annotations

from raygraph.graph import InputNode, MultiOutputNode, dapo, step_metrics
from raygraph.graph.fragments import advantages, rollout_columns

ROLES = ("policy", "rollout", "reward")
ESTIMATORS = ("grpo", "dr_grpo", "rloo")   # group-relative estimators: a kept group is self-contained


def build(roles, cfg, *, metric: str = "acc"):
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        scored = roles.gather(rollouts, *rollout_columns(roles, cfg, rollouts))
        kept = roles.apply(dapo.filter_groups, scored, metric=metric)
        batch = advantages(roles, cfg, kept, prompts)
        update = roles.policy.bind("update", batch)
        metrics = [roles.apply(step_metrics.rollout_metrics, scored), roles.apply(dapo.shaping_metrics, kept)]
        return MultiOutputNode([roles.gather(update), roles.sync_weights(after=update), *metrics])
