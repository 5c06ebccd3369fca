"""DPO: direct preference optimisation on (prompt, chosen, rejected) pairs (Rafailov et al. 2023).

One step::

    pairs ─► reference.logprobs (frozen) ─► gather ─► policy.dpo_update ─► weight sync

With `model.lora` the reference is the policy's own model with its adapter disabled
(`policy.ref_logprobs`), so no reference model is loaded.

Rows come in pairs, chosen then rejected, sharing a `uid`, so every split keeps a pair on one
rank. The loss is `algorithm.dpo_loss` (`sigmoid` as in the paper, or `ipo`, Azar et al. 2023)
with `algorithm.dpo_beta`. Departures from the paper: none in the loss; like SFT, the rollout
and reward roles serve validation only (greedy accuracy on `data.val_files`).
"""

from __future__ import annotations

from raygraph.graph import InputNode, MultiOutputNode
from raygraph.graph.fragments import reference_logprobs

ROLES = ("policy", "reference", "rollout", "reward")
DATA_FORMAT = "dpo"
ESTIMATORS = ()  # no advantage estimator: algorithm.advantage must stay unset


def build(roles, cfg):
    with InputNode() as pairs:
        batch = roles.gather(pairs, reference_logprobs(roles, cfg, pairs))
        update = roles.policy.bind("dpo_update", batch, beta=cfg.algorithm.dpo_beta,
                                   kind=cfg.algorithm.dpo_loss)
        sync = roles.sync_weights(after=update)
        return MultiOutputNode([roles.gather(update), sync])
