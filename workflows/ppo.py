"""PPO with a learned critic and GAE (Schulman et al. 2017; RLHF form of Ouyang et al. 2022).

One step::

    prompts ─► rollout.generate ─┬─► reward.score
                                 ├─► policy.logprobs    (old_logprobs)
                                 ├─► critic.values      (values)
                                 └─► reference.logprobs (with a KL term)
    gather ─► advantages (GAE, whitened over the whole batch) ─┬─► critic.update
                                                               └─► policy.update ─► weight sync

Departures from the paper: the reward is a sequence-level score on the last response token; the
KL penalty to the reference goes into the token reward (`algorithm.kl_in_reward.coef`, fixed or
adaptive controller, as in Ziegler et al. 2019) or into the loss (`actor.kl_loss_coef`). Critic
and policy updates read the same batch and do not wait for each other.
"""

from __future__ import annotations

from raygraph.graph import InputNode, MultiOutputNode, step_metrics
from raygraph.graph.fragments import advantages, rollout_columns, update_batch

ROLES = ("policy", "rollout", "reward", "critic")
ESTIMATORS = ("gae",)


def build(roles, cfg):
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        parts = [rollouts, *rollout_columns(roles, cfg, rollouts), roles.critic.bind("values", rollouts)]
        batch = advantages(roles, cfg, roles.gather(*parts), prompts)   # GAE, whitened over the whole batch
        critic_update = roles.critic.bind("update", batch)
        train_batch, correction = update_batch(roles, cfg, batch)   # IS corrections, when configured
        policy_update = roles.policy.bind("update", train_batch)
        sync = roles.sync_weights(after=policy_update)
        return MultiOutputNode([roles.gather(policy_update), roles.gather(critic_update), sync,
                                roles.apply(step_metrics.rollout_metrics, batch), *correction])
