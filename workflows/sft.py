"""SFT: supervised fine-tuning on prompt/response pairs (token-mean NLL of the response tokens).

One step::

    pairs (driver reads parquet) ─► policy.sft_update ─► weight sync ─► (validation: greedy rollout)

The rollout and reward roles are only used by validation, so SFT reports the same `val/accuracy`
as the RL workflows. Data: `data.format: sft`, rows with `prompt` and `response` (without a
`response` column, `reward_model.ground_truth` is the target, so RL data can be used as is).

Why not Ray Train's `TorchTrainer`: the same role groups, checkpoints, weight sync and metrics
serve RL and offline training, so an SFT warm start and the RL run that follows share one
process layout and one checkpoint format; TorchTrainer would add a second worker lifecycle for
no gain at this size.
"""

from __future__ import annotations

from raygraph.graph import InputNode, MultiOutputNode

ROLES = ("policy", "rollout", "reward")
DATA_FORMAT = "sft"
ESTIMATORS = ()  # no advantage estimator: algorithm.advantage must stay unset


def build(roles, cfg):
    with InputNode() as pairs:
        update = roles.policy.bind("sft_update", pairs)
        sync = roles.sync_weights(after=update)
        return MultiOutputNode([roles.gather(update), sync])
