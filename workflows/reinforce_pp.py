"""REINFORCE++ (Hu 2025): return-to-go with a KL-shaped token reward, whitened over the batch.

The DAG is GRPO's (see `workflows/grpo.py`); the advantage is `reinforce_pp` (global batch
whitening, no per-group statistics) or, with `algorithm.advantage=reinforce_pp_baseline`, the
variant that first subtracts each prompt's mean score. Departures from the paper: the KL term is
where the config puts it — the paper folds a k1 KL into the token reward
(`algorithm.kl_in_reward.coef > 0`); the shipped config does exactly that.
"""

from __future__ import annotations

from raygraph.workflows import grpo

ROLES = grpo.ROLES
ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")
MAX_STALENESS = grpo.MAX_STALENESS
build = grpo.build
