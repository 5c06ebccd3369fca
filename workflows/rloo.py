"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024).

The DAG is GRPO's (see `workflows/grpo.py`); only the advantage differs: each sample's baseline
is the mean score of the OTHER samples of its prompt, `A_i = n/(n-1) · (r_i − mean(r))`, with no
std division. Departures from the paper: the update is the clipped PPO surrogate
(`actor.policy_loss`, ratio 1 on the first pass) rather than plain REINFORCE; set
`actor.policy_loss=reinforce` for the paper's form. Needs `rollout.n >= 2`.
"""

from __future__ import annotations

from raygraph.workflows import grpo

ROLES = grpo.ROLES
ESTIMATORS = ("rloo",)
MAX_STALENESS = grpo.MAX_STALENESS
build = grpo.build
