"""Remote reward worker: POST a batch to the user's HTTP service (e.g. a reward model served
by vLLM behind a small adapter) and place the returned scores on the last response token.

Protocol (JSON over HTTP POST to `url`, one request per `score` call):

    request  {"prompts":       [str, ...],   # prompt text after the chat template
              "responses":     [str, ...],   # decoded responses, special tokens skipped
              "ground_truths": [str | null, ...],
              "data_sources":  [str | null, ...]}
    response {"scores": [float, ...],                     # one per row, required
              "extras": {"name": [float, ...], ...}}      # optional, one value per row each

All lists have one entry per row, in order. With ``auth_env="MY_TOKEN"`` the request carries
``Authorization: Bearer $MY_TOKEN``. Timeouts, connection errors, HTTP 5xx and 429 are retried
up to `max_retries` times, sleeping ``backoff_s * 2**k`` before retry k (k = 0, 1, ...); other
HTTP errors, a body that is not JSON, a missing ``scores`` list or a list of the wrong length
fail at once. Failing raises `RuntimeError` naming the URL, the attempts and the last error.
An empty response still gets its score from the service, but it is placed nowhere (score 0;
see `raygraph.rewards.batching`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import requests

from raygraph.batch import (
    DATA_SOURCE,
    GROUND_TRUTH,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_TEXT,
    RESPONSE_MASK,
    RESPONSES,
    Batch,
)
from raygraph.rewards.batching import decode_responses, reward_batch

__all__ = ["RemoteRewardWorker"]

_RETRY_STATUS = frozenset({429}) | frozenset(range(500, 600))


class _Retryable(Exception):
    """A failure worth another attempt (timeout, connection error, 5xx, 429)."""


class RemoteRewardWorker:
    """Client of a remote reward service (protocol in the module docstring).

    Args:
        url: the service endpoint, e.g. "http://rm-host:8000/score".
        tokenizer_path: path or hub id of the policy's tokenizer (to decode responses).
        timeout_s: per-request timeout (connect and read) in seconds.
        max_retries: retries after the first attempt (attempts = max_retries + 1).
        backoff_s: first retry delay; doubled for each further retry.
        auth_env: name of an environment variable holding a bearer token, or None.
    """

    def __init__(self, url: str, tokenizer_path: str, timeout_s: float = 30, max_retries: int = 3,
                 backoff_s: float = 1.0, auth_env: str | None = None) -> None:
        from transformers import AutoTokenizer

        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("need timeout_s > 0, max_retries >= 0 and backoff_s >= 0")
        if auth_env is not None and not os.environ.get(auth_env):
            raise ValueError(f"auth_env={auth_env!r} but that environment variable is not set")
        self.url, self.timeout_s, self.max_retries, self.backoff_s = url, timeout_s, max_retries, backoff_s
        self.auth_env = auth_env
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self._session = requests.Session()

    def score(self, batch: Batch) -> Batch:
        """POST the batch and return `token_level_scores` (B, R) and `reward_extra.<name>` (B,)."""
        mask = batch[RESPONSE_MASK]
        n = len(batch)
        payload = {
            "prompts": self._prompts(batch),
            "responses": decode_responses(self.tokenizer, batch[RESPONSES], mask),
            "ground_truths": _plain(batch[GROUND_TRUTH]) if GROUND_TRUTH in batch else [None] * n,
            "data_sources": _plain(batch[DATA_SOURCE]) if DATA_SOURCE in batch else [None] * n,
        }
        answer = self._post(payload)
        scores, extras = self._check(answer, n)
        return reward_batch(scores, extras, mask)

    def _prompts(self, batch: Batch) -> list[str]:
        if PROMPT_TEXT in batch:
            return [str(t) for t in batch[PROMPT_TEXT]]
        ids = [row[m.bool()].tolist() for row, m in zip(batch[PROMPT_IDS], batch[PROMPT_MASK])]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=False)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.auth_env is not None:
            headers["Authorization"] = f"Bearer {os.environ.get(self.auth_env, '')}"
        return headers

    def _post(self, payload: dict[str, Any]) -> Any:
        last_error = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._post_once(payload)
            except _Retryable as e:
                last_error = e
        raise RuntimeError(f"reward service {self.url} failed after {self.max_retries + 1} attempts "
                           f"(timeout {self.timeout_s}s each); last error: {last_error}")

    def _post_once(self, payload: dict[str, Any]) -> Any:
        try:
            r = self._session.post(self.url, json=payload, headers=self._headers(),
                                   timeout=self.timeout_s)
        except requests.Timeout as e:
            raise _Retryable(f"timeout: {e}") from e
        except requests.ConnectionError as e:
            raise _Retryable(f"connection error: {e}") from e
        if r.status_code in _RETRY_STATUS:
            raise _Retryable(f"HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise RuntimeError(f"reward service {self.url} answered HTTP {r.status_code} "
                               f"(not retried): {r.text[:200]}")
        try:
            return r.json()
        except ValueError:
            raise RuntimeError(f"reward service {self.url} answered non-JSON: {r.text[:200]!r}") from None

    def _check(self, answer: Any, n: int) -> tuple[list[float], dict[str, list[float]]]:
        if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
            raise RuntimeError(f"reward service {self.url} answered without a 'scores' list: "
                               f"{str(answer)[:200]}")
        scores = answer["scores"]
        extras = answer.get("extras") or {}
        if not isinstance(extras, dict):
            raise RuntimeError(f"reward service {self.url}: 'extras' must be an object of lists")
        for name, values in [("scores", scores), *((f"extras.{k}", v) for k, v in extras.items())]:
            if not isinstance(values, list) or len(values) != n:
                got = len(values) if isinstance(values, list) else type(values).__name__
                raise RuntimeError(f"reward service {self.url} returned {got} {name} for {n} rows")
        return [float(s) for s in scores], {k: [float(x) for x in v] for k, v in extras.items()}


def _plain(values: Any) -> list[Any]:
    """JSON-safe list: strings stay, None stays, anything else becomes its str()."""
    return [v if v is None or isinstance(v, str) else str(v) for v in values]
