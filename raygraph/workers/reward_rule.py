"""Rule-based reward worker: decode responses, score them with `raygraph.rewards`, place the
score on the last response token.

Plain Python + torch (no Ray). The reward of a row is chosen by its `data_source`
(`raygraph.rewards.score_for_source`) unless functions are named: one for every row, or several
with weights (`raygraph.rewards.terms`: score = sum of weight x function). Calls run inline, or in
a pool of `workers` processes where `timeout_s` bounds each call (`raygraph.rewards.pool`); a
failing call follows `on_error`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from raygraph.batch import DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH, RESPONSE_MASK, RESPONSES, UID, Batch
from raygraph.rewards import get, score_for_source
from raygraph.rewards.batching import decode_responses, reward_batch
from raygraph.rewards.pool import RewardPool
from raygraph.rewards.terms import Call, call_one, combine, make_terms

__all__ = ["RuleRewardWorker"]


class RuleRewardWorker:
    """Scores rollouts with rule functions.

    Args:
        tokenizer_path: path or hub id of the policy's tokenizer (to decode `responses`).
        function: a reward name from `raygraph.rewards.names()` (or `file.py:fn`) used for every
            row; None selects each row's reward by its `data_source`.
        on_non_finite: "fail" | "zero", what a NaN/Inf score does (`raygraph.rewards.batching`).
        functions: several weighted functions instead of `function`: mappings with keys
            `function`, `weight` and optionally `name` (the metric name, `reward/<name>/mean`).
        workers: processes in the scoring pool; 0 = call the functions in this process.
        timeout_s: seconds one call may run (needs workers >= 1); None = no limit.
        on_error: "fail" | "zero", what a call that raises or times out does (`raygraph.rewards.terms`).
        plugins: user modules or files the pool's processes import (this process already has).
    """

    def __init__(self, tokenizer_path: str, function: str | None = None, on_non_finite: str = "fail",
                 functions: Sequence[Mapping[str, Any]] = (), workers: int = 0, timeout_s: float | None = None,
                 on_error: str = "fail", plugins: Sequence[str] = ()) -> None:
        from transformers import AutoTokenizer

        if timeout_s is not None and workers < 1:
            raise ValueError("timeout_s needs workers >= 1: a call in this process cannot be interrupted")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.terms = make_terms(function, functions)
        self._fns = [None if t.ref is None else get(t.ref) for t in self.terms]   # fails early on a bad name
        self._named = bool(functions)
        self.on_non_finite, self.on_error = on_non_finite, on_error
        self._pool = RewardPool([t.ref for t in self.terms], workers, plugins, timeout_s) if workers else None

    def score(self, batch: Batch) -> Batch:
        """Score every row of `batch`.

        Reads `responses` (B, R), `response_mask` (B, R), `ground_truth`, and `data_source`
        (unless functions were named); `extra_info` and `uid` if present.

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
        sources = batch[DATA_SOURCE] if DATA_SOURCE in batch else [None] * n
        uids = list(batch[UID]) if UID in batch else None
        lengths = mask.sum(dim=1).tolist()
        for i in range(n):
            if lengths[i] > 0 and truths[i] is None:
                raise ValueError(f"row {i} has no ground_truth; rule rewards need "
                                 "reward_model.ground_truth in the dataset")
        if self._fns[0] is None:   # by data source: an unknown source is a data problem, said before any call
            for i in range(n):
                if lengths[i] > 0:
                    score_for_source(sources[i])
        calls = [Call(k, i, texts[i], truths[i], infos[i], sources[i])
                 for i in range(n) if lengths[i] > 0 for k in range(len(self.terms))]
        results = self._pool.run(calls) if self._pool else [call_one(self._fn_for, c) for c in calls]
        scores, extras = combine(self.terms, {(c.term, c.row): r for c, r in zip(calls, results)}, n,
                                 uids=uids, on_error=self.on_error, named=self._named)
        return reward_batch(scores, extras, mask, source=self._source(), uids=uids,
                            on_non_finite=self.on_non_finite)

    def _fn_for(self, call: Call):
        return self._fns[call.term] or score_for_source(call.source)

    def _source(self) -> str:
        if len(self.terms) > 1:
            return "the weighted reward functions " + ", ".join(repr(t.name) for t in self.terms)
        if self.terms[0].ref is not None:
            return f"reward function {self.terms[0].ref!r}"
        return "the rule reward chosen by data_source"

    def close(self) -> None:
        """Stop the scoring pool's processes (they also stop when this process exits)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
