"""ReMax (Li et al. 2024): REINFORCE whose baseline is the reward of the GREEDY response.

One step::

    prompts ─┬─► rollout.generate (n samples) ─┬─► reward.score, policy.logprobs, [reference]
             └─► rollout.generate (greedy, 1) ──┴─► reward.score  (the baseline branch)
    gather ─► attach baselines ─► advantages (return-to-go − baseline) ─► policy.update ─► sync

Departures from the paper: the greedy branch runs in the same DAG step as the sampled rollouts
(same weights, one extra generate per prompt), and the update uses the clipped surrogate
(`actor.policy_loss`, ratio 1 on the first pass); `actor.policy_loss=reinforce` gives the paper's.
"""

from __future__ import annotations

from raygraph.graph import InputNode, MultiOutputNode, step_metrics, whole_batch
from raygraph.graph.fragments import advantages, rollout_columns, update_batch

ROLES = ("policy", "rollout", "reward")
ESTIMATORS = ("remax",)


def build(roles, cfg):
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        greedy = roles.rollout.bind("generate", prompts, greedy=True, n=1)
        baseline = roles.gather(greedy, roles.reward.bind("score", greedy))
        parts = [rollouts, *rollout_columns(roles, cfg, rollouts)]
        batch = roles.apply(whole_batch.attach_reward_baselines, roles.gather(*parts), baseline)
        batch = advantages(roles, cfg, batch, prompts)
        train_batch, correction = update_batch(roles, cfg, batch)   # IS corrections, when configured
        update = roles.policy.bind("update", train_batch)
        sync = roles.sync_weights(after=update)
        return MultiOutputNode([roles.gather(update), sync, roles.apply(step_metrics.rollout_metrics, batch),
                                *correction])
