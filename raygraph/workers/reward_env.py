"""The reward of multi-turn episodes (`reward.kind: env`): what their environment gave.

The rollout already holds the environment's rewards, each on the last token of the turn it
followed (`env_scores`, `raygraph.workers.agent_rollout`); this worker hands them on as
`token_level_scores`, so every advantage estimator sees per-turn rewards where they were given
(outcome estimators sum them; GAE / REINFORCE++ discount them from where they sit).
"""

from __future__ import annotations

import torch

from raygraph.batch import ENV_SCORES, RESPONSE_MASK, REWARD_EXTRA_PREFIX, TOKEN_LEVEL_SCORES, Batch

__all__ = ["EnvRewardWorker"]


class EnvRewardWorker:
    """Passes the environment's rewards on. Extras: `acc` (1 when the episode's return is > 0) and
    `return` (the episode's summed reward)."""

    def score(self, batch: Batch) -> Batch:
        if ENV_SCORES in batch:
            scores = batch[ENV_SCORES].float()
        elif len(batch) == 0:   # an empty refill round carries no episode columns
            scores = torch.zeros(batch[RESPONSE_MASK].shape)
        else:
            raise ValueError("reward.kind=env scores multi-turn episodes, and these rows have no env_scores: "
                             "set rollout.agent.env (the environment whose rewards these are)")
        total = scores.sum(-1)
        return Batch({TOKEN_LEVEL_SCORES: scores, f"{REWARD_EXTRA_PREFIX}acc": (total > 0).float(),
                      f"{REWARD_EXTRA_PREFIX}return": total})

    def close(self) -> None:
        pass
