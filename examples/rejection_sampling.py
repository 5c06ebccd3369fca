"""Rejection-sampling fine-tuning (RFT): sample n answers per prompt, keep the rewarded ones,
and fine-tune on them with plain NLL (as in Dong et al. 2023, "RAFT", and Yuan et al. 2023).

One step::

    prompts ─► rollout.generate (n samples) ─► reward.score ─► gather
            ─► keep rows whose score > 0 (as SFT rows) ─► policy.sft_update ─► weight sync

Use it with `workflow: examples/rejection_sampling.py:build` in any RL config.
"""

from __future__ import annotations

import torch

from raygraph.batch import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOSS_MASK,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_MASK,
    RESPONSES,
    Batch,
)
from raygraph.graph import InputNode, MultiOutputNode, step_metrics, whole_batch

ROLES = ("policy", "rollout", "reward")


def accepted_as_sft(batch: Batch) -> Batch:
    """Rollouts -> SFT rows; rejected samples keep their row but get an all-zero loss mask."""
    accepted = (whole_batch.sequence_scores(batch) > 0).long()  # (B,)
    response_mask = batch[RESPONSE_MASK] * accepted[:, None]  # (B, R)
    return batch.with_columns(**{
        INPUT_IDS: torch.cat([batch[PROMPT_IDS], batch[RESPONSES]], dim=1),
        ATTENTION_MASK: torch.cat([batch[PROMPT_MASK], batch[RESPONSE_MASK]], dim=1),
        LOSS_MASK: torch.cat([torch.zeros_like(batch[PROMPT_MASK]), response_mask], dim=1),
    })


def build(roles, cfg):
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        scored = roles.gather(rollouts, roles.reward.bind("score", rollouts))
        update = roles.policy.bind("sft_update", roles.apply(accepted_as_sft, scored))
        sync = roles.sync_weights(after=update)
        return MultiOutputNode([roles.gather(update), sync, roles.apply(step_metrics.rollout_metrics, scored)])
