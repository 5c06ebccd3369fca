"""On-policy distillation: the student (the policy) samples, a frozen teacher scores every sampled
token, and each token's advantage is minus the student's log-ratio to the teacher there, so the
update lowers the per-token reverse KL to the teacher on the student's own samples (Agarwal et
al. 2024, GKD with the reverse KL; `raygraph.algos.distill`).

One step::

    prompts ─► rollout.generate ─┬─► teacher.logprobs (teacher_logprobs)
                                 └─► reward.score     (for the metrics only)
    gather ─► advantages = -coef (log pi - log q), per token ─► policy.update ─► weight sync

The teacher is a role of this workflow's own: give its model in the config, e.g.
`extra_roles: {teacher: {model_path: /models/teacher}}`; it is placed like the reference (or on
a pool of its own with `placement.roles.teacher`) and may be FSDP-sharded (`shard: true`).

How this departs from the papers (all config, same file):
- Only the sampled token's log-ratio is used (a one-sample estimate), not the full-vocabulary
  KL: the teacher returns one log-prob per token, so teacher and student may live on separate
  devices and only `(B, R)` floats travel.
- No credit flows to earlier tokens (discount 0): each token is pushed by its own log-ratio.
- The task reward is logged (`reward/*`) but not trained on; `workflow_args.coef` scales the
  distillation advantage.
"""

from __future__ import annotations

from raygraph import batch as columns
from raygraph.algos.distill import reverse_kl, reverse_kl_advantages
from raygraph.batch import OLD_LOGPROBS, RESPONSE_MASK, RETURNS, ROLLOUT_LOGPROBS, Batch
from raygraph.graph import InputNode, MultiOutputNode, step_metrics, whole_batch
from raygraph.graph.fragments import rollout_columns

ROLES = ("policy", "rollout", "reward", "teacher")
ESTIMATORS = ()   # no registered estimator: the advantages are the teacher's log-ratios
TEACHER_LOGPROBS = "teacher_logprobs"   # the teacher role's column (`<role>_logprobs`)


def distillation_advantages(batch: Batch, *, coef: float, old_from_rollout: bool) -> Batch:
    """`advantages = -coef (rollout_logprobs - teacher_logprobs)` per response token."""
    if old_from_rollout:
        batch = whole_batch.use_rollout_logprobs(batch)
    adv = reverse_kl_advantages(batch[ROLLOUT_LOGPROBS], batch[TEACHER_LOGPROBS], batch[RESPONSE_MASK], coef=coef)
    return batch.with_columns(**{columns.ADVANTAGES: adv, RETURNS: adv})


def distillation_metrics(batch: Batch) -> dict[str, float]:
    """`distill/reverse_kl`: the batch's mean per-token reverse-KL estimate to the teacher."""
    student = batch[OLD_LOGPROBS] if OLD_LOGPROBS in batch else batch[ROLLOUT_LOGPROBS]
    return {"distill/reverse_kl": reverse_kl(student, batch[TEACHER_LOGPROBS], batch[RESPONSE_MASK])}


def build(roles, cfg, *, coef: float = 1.0):
    """The per-step DAG; `coef` (`workflow_args.coef`) scales the distillation advantage."""
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        scored = roles.gather(rollouts, roles.teacher.bind("logprobs", rollouts),
                              *rollout_columns(roles, cfg, rollouts))
        batch = roles.apply(distillation_advantages, scored, coef=coef,
                            old_from_rollout=cfg.old_logprobs_source == "rollout")
        update = roles.policy.bind("update", batch)
        return MultiOutputNode([roles.gather(update), roles.sync_weights(after=update),
                                roles.apply(step_metrics.rollout_metrics, batch),
                                roles.apply(distillation_metrics, batch)])
