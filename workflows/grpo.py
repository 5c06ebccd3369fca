"""GRPO: group-relative advantages, no critic (Shao et al. 2024, DeepSeekMath).

One step::

    prompts ─► rollout.generate (n samples per prompt) ─┬─► reward.score
                                                         ├─► policy.logprobs   (old_logprobs; see below)
                                                         └─► reference.logprobs (only with a KL term)
    gather ─► advantages (whole batch: per-group normalisation) ─► policy.update ─► weight sync

Asynchronous (`placement.max_staleness=1`, disaggregated placement only), one-step off-policy::

    prompts ─► rollout.take_or_generate (sampled during the last update) ─► ... as above ...
           ─► truncated IS ─► policy.update ─┐
           └► rollout.prefetch_next (the next step's prompts, with the weights of now) ─┴► weight sync

Streaming (`rollout.streaming`, any `placement.max_staleness` k): the rollout ranks generate the
next k steps' prompts continuously and take each weight update as it lands (docs/streaming.md)::

    prompts ─► rollout.stream_take (the step's finished groups) ─► ... as above ... ─► weight sync

How this departs from the paper (all config, same file):
- The advantage estimator is `algorithm.advantage`, one of ESTIMATORS: `grpo` (paper, the
  default), `dr_grpo` (no std division, Liu et al. 2025), or another outcome estimator.
- Loss aggregation is `actor.loss_agg` (`token-mean` is DAPO's choice; the paper's per-sequence
  mean is `seq-mean-token-mean`).
- KL to the reference is in the loss (`actor.kl_loss_coef`, k3 by default, as in the paper) or in
  the reward (`algorithm.kl_in_reward.coef`), or absent (no reference role is started then).
- One policy update per batch by default (`actor.ppo_epochs`, `actor.mini_batch_size`), so the
  clipped ratio only matters with several mini-batches or epochs; with one, the old log-probs are
  the update's own (detached) and `policy.logprobs` is not run (`actor.old_logprobs`, auto).
- `algorithm.rollout_correction` (off by default) corrects every token for the rollout engine's
  mismatch with the trainer (truncated or masked IS on `pi_old / pi_rollout`, with the old
  log-probs recomputed by the trainer; `raygraph.graph.corrections.correct_rollouts`).
- DAPO's options (Yu et al. 2025; `raygraph.graph.dapo`, all off by default):
  `algorithm.overlong_penalty` (soft length penalty), `algorithm.mask_truncated` (cut responses
  leave the loss), `algorithm.dynamic_sampling` (groups whose accuracy does not vary are dropped;
  up to `max_extra_rounds` more rounds generate from the next prompts of the data order until
  `data.prompts_per_step` groups are kept, as in the paper but with a bound; a batch still short
  after them trains as it is, and an empty one makes no optimizer step).
- Asynchronous mode trains on rollouts one weight version old: the ratio is clipped around the
  policy before the update (`old_logprobs`) and each token's advantage is weighted by
  `min(pi_old / pi_rollout, algorithm.is_cap)` (decoupled PPO with truncated IS, see
  `raygraph.graph.corrections.truncated_importance_weights`). The first step (or one after a
  resume with nothing prefetched) samples synchronously.
"""

from __future__ import annotations

from raygraph.graph import InputNode, MultiOutputNode, step_metrics
from raygraph.graph.fragments import (
    advantages,
    first_round_prompts,
    rollout_columns,
    shape_rollouts,
    update_batch,
)

ROLES = ("policy", "rollout", "reward")
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")  # first: the default
MAX_STALENESS = 1  # the largest placement.max_staleness this DAG implements without streaming


def build(roles, cfg):
    """Build the per-step DAG; `cfg.algorithm.advantage` is one of ESTIMATORS (checked by the config)."""
    pipelined = cfg.placement.max_staleness > 0 and not cfg.rollout.streaming
    with InputNode() as prompts:
        rollouts = roles.rollout.bind(
            "stream_take" if cfg.rollout.streaming else "take_or_generate" if pipelined else "generate",
            first_round_prompts(roles, cfg, prompts))
        scored = roles.gather(rollouts, *rollout_columns(roles, cfg, rollouts))
        scored, shaping = shape_rollouts(roles, cfg, scored, prompts)   # DAPO options: the batch may change size
        batch = advantages(roles, cfg, scored, prompts)   # whole batch: per-group normalisation
        train_batch, correction = update_batch(roles, cfg, batch)   # IS corrections, when configured
        metrics = [roles.apply(step_metrics.rollout_metrics, batch), *correction, *shaping]
        update = roles.policy.bind("update", train_batch)
        if not pipelined:
            return MultiOutputNode([roles.gather(update), roles.sync_weights(after=update), *metrics])
        # The rollout ranks sample the next step while the policy trains, and receive the new
        # weights only after that (a data dependency: the sync waits for both).
        ahead = roles.rollout.bind("prefetch_next", prompts)
        sync = roles.sync_weights(after=roles.gather(update, ahead))
        return MultiOutputNode([*metrics, roles.gather(update), sync])   # metrics first: run during the update
