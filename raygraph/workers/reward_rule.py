"""Rule-based reward worker: decode responses, score them with `raygraph.rewards`, place the
score on the last response token.

Plain Python + torch (no Ray). The reward of a row is chosen by its `data_source`
(`raygraph.rewards.score_for_source`) unless one function is named for every row.
"""

from __future__ import annotations

from raygraph.batch import DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH, RESPONSE_MASK, RESPONSES, UID, Batch
from raygraph.rewards import get, score_for_source
from raygraph.rewards.batching import as_score, decode_responses, reward_batch

__all__ = ["RuleRewardWorker"]


class RuleRewardWorker:
    """Scores rollouts with rule functions.

    Args:
        tokenizer_path: path or hub id of the policy's tokenizer (to decode `responses`).
        function: a reward name from `raygraph.rewards.names()` used for every row; None
            selects each row's reward by its `data_source`.
        on_non_finite: "fail" | "zero", what a NaN/Inf score does (`raygraph.rewards.batching`).
    """

    def __init__(self, tokenizer_path: str, function: str | None = None, on_non_finite: str = "fail") -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self._fixed = get(function) if function is not None else None
        self._name = function
        self.on_non_finite = on_non_finite

    def score(self, batch: Batch) -> Batch:
        """Score every row of `batch`.

        Reads `responses` (B, R), `response_mask` (B, R), `ground_truth`, and `data_source`
        (unless a function was fixed); `extra_info` if present.

        Returns:
            Batch with `token_level_scores` (B, R) float32 — the score at index
            ``response_length - 1``, zero elsewhere; a row with an empty response scores 0 and
            has an all-zero row — and `reward_extra.<name>` (B,) float32 for every extra any row
            reported (0.0 for rows that did not report it, and for empty responses).
        """
        mask = batch[RESPONSE_MASK]
        texts = decode_responses(self.tokenizer, batch[RESPONSES], mask)
        n = len(texts)
        truths = batch[GROUND_TRUTH]
        infos = batch[EXTRA_INFO] if EXTRA_INFO in batch else [None] * n
        sources = batch[DATA_SOURCE] if self._fixed is None else [None] * n
        uids = list(batch[UID]) if UID in batch else None
        lengths = mask.sum(dim=1).tolist()
        scores, extras = [0.0] * n, {}
        for i in range(n):
            if lengths[i] == 0:
                continue
            fn = self._fixed or score_for_source(sources[i])
            if truths[i] is None:
                raise ValueError(f"row {i} has no ground_truth; rule rewards need "
                                 "reward_model.ground_truth in the dataset")
            result = fn(texts[i], truths[i], infos[i])
            source = self._source(sources[i])
            uid = uids[i] if uids else None
            scores[i] = as_score(result.score, source, i, uid)
            for name, value in result.extras.items():
                extras.setdefault(name, [0.0] * n)[i] = as_score(value, f"{source} (extra {name!r})", i, uid)
        source = self._source(None) if self._fixed else "the rule reward chosen by data_source"
        return reward_batch(scores, extras, mask, source=source, uids=uids, on_non_finite=self.on_non_finite)

    def _source(self, data_source: str | None) -> str:
        if self._fixed is not None:
            return f"reward function {self._name!r}"
        return f"the rule reward of data_source {data_source!r}"
