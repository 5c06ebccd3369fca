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
``Authorization: Bearer $MY_TOKEN`` (a warning is logged when that goes over plain http to a host
that is not this machine). `timeout_s` is a total deadline per attempt: connecting, sending and
reading the whole answer (a server that drips bytes is cut off at the deadline, its connection
shut down). Timeouts, connection errors, HTTP 5xx and 429 are retried up to `max_retries` times,
sleeping ``backoff_s * 2**k`` before retry k (k = 0, 1, ...); other HTTP errors, a body that is
not JSON, a missing ``scores`` list, a list of the wrong length, or a score that is not a number
(a string, null) fail at once. Failing raises `RuntimeError` naming the URL, the attempts and the
last error (or, for a bad score, `TypeError` naming the service and the row). A non-finite score
follows `on_non_finite` (see `raygraph.rewards.batching`).
An empty response still gets its score from the service, but it is placed nowhere (score 0;
see `raygraph.rewards.batching`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Any
from urllib.parse import urlparse

import requests

from raygraph.batch import (
    DATA_SOURCE,
    GROUND_TRUTH,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_TEXT,
    RESPONSE_MASK,
    RESPONSES,
    UID,
    Batch,
)
from raygraph.rewards.batching import as_score, decode_responses, reward_batch

__all__ = ["RemoteRewardWorker"]

log = logging.getLogger("raygraph")

_RETRY_STATUS = frozenset({429}) | frozenset(range(500, 600))


class _Retryable(Exception):
    """A failure worth another attempt (timeout, connection error, 5xx, 429)."""


class _Deadline(_Retryable):
    """No complete answer within the attempt's total deadline."""


class RemoteRewardWorker:
    """Client of a remote reward service (protocol in the module docstring).

    Args:
        url: the service endpoint, e.g. "http://rm-host:8000/score".
        tokenizer_path: path or hub id of the policy's tokenizer (to decode responses).
        timeout_s: total deadline of one attempt (connect, send, read the whole answer), seconds.
        max_retries: retries after the first attempt (attempts = max_retries + 1).
        backoff_s: first retry delay; doubled for each further retry.
        auth_env: name of an environment variable holding a bearer token, or None.
        on_non_finite: "fail" | "zero", what a NaN/Inf score does.
    """

    def __init__(self, url: str, tokenizer_path: str, timeout_s: float = 30, max_retries: int = 3,
                 backoff_s: float = 1.0, auth_env: str | None = None, on_non_finite: str = "fail") -> None:
        from transformers import AutoTokenizer

        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("need timeout_s > 0, max_retries >= 0 and backoff_s >= 0")
        if auth_env is not None and not os.environ.get(auth_env):
            raise ValueError(f"auth_env={auth_env!r} but that environment variable is not set")
        if auth_env is not None and token_sent_in_clear(url):
            log.warning("reward service %s: the bearer token from $%s goes over plain http to a host that is "
                        "not this machine; anyone on the path can read it (use https)", url, auth_env)
        self.url, self.timeout_s, self.max_retries, self.backoff_s = url, timeout_s, max_retries, backoff_s
        self.auth_env = auth_env
        self.on_non_finite = on_non_finite
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self._session = requests.Session()

    def score(self, batch: Batch) -> Batch:
        """POST the batch and return `token_level_scores` (B, R) and `reward_extra.<name>` (B,)."""
        mask = batch[RESPONSE_MASK]
        n = len(batch)
        if n == 0:   # nothing to score (e.g. an unneeded DAPO refill round): no request
            return reward_batch([], {}, mask, source=f"reward service {self.url}", uids=[],
                                on_non_finite=self.on_non_finite)
        payload = {
            "prompts": self._prompts(batch),
            "responses": decode_responses(self.tokenizer, batch[RESPONSES], mask),
            "ground_truths": _plain(batch[GROUND_TRUTH]) if GROUND_TRUTH in batch else [None] * n,
            "data_sources": _plain(batch[DATA_SOURCE]) if DATA_SOURCE in batch else [None] * n,
        }
        answer = self._post(payload)
        uids = list(batch[UID]) if UID in batch else None
        scores, extras = self._check(answer, n, uids)
        return reward_batch(scores, extras, mask, source=f"reward service {self.url}", uids=uids,
                            on_non_finite=self.on_non_finite)

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
                           f"(deadline {self.timeout_s}s each); last error: {last_error}")

    def _post_once(self, payload: dict[str, Any]) -> Any:
        """One attempt, bounded by `timeout_s` in total (requests' own timeout is per socket read)."""
        attempt = _Attempt(self._session, self.url, payload, self._headers(), self.timeout_s)
        try:
            r = attempt.run()
        except _Deadline:
            self._session = requests.Session()  # the abandoned attempt may still hold the old one
            raise
        if r.status_code in _RETRY_STATUS:
            raise _Retryable(f"HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise RuntimeError(f"reward service {self.url} answered HTTP {r.status_code} "
                               f"(not retried): {r.text[:200]}")
        try:
            return r.json()
        except ValueError:
            raise RuntimeError(f"reward service {self.url} answered non-JSON: {r.text[:200]!r}") from None

    def _check(self, answer: Any, n: int, uids: list | None = None) -> tuple[list[float], dict[str, list[float]]]:
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
        source = f"reward service {self.url}"
        return ([as_score(x, source, i, uids[i] if uids else None) for i, x in enumerate(scores)],
                {k: [as_score(x, f"{source} (extra {k!r})", i, uids[i] if uids else None) for i, x in enumerate(v)]
                 for k, v in extras.items()})


class _Attempt:
    """One POST run in a helper thread and waited for with a total deadline.

    At the deadline the connection is shut down (which ends the helper's blocked read) and the
    attempt counts as a timeout. The body is read inside the helper, so a server that sends the
    headers and then drips the body one byte at a time is cut off too.
    """

    def __init__(self, session: requests.Session, url: str, payload: Any, headers: dict, timeout_s: float):
        self.session, self.url, self.payload, self.headers, self.timeout_s = session, url, payload, headers, timeout_s
        self.response: requests.Response | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def _work(self) -> None:
        try:
            r = self.session.post(self.url, json=self.payload, headers=self.headers,
                                  timeout=self.timeout_s, stream=True)
            self.response = r
            _ = r.content  # read the whole body here, under the deadline
        except BaseException as e:  # handed to the caller
            self.error = e
        finally:
            self.done.set()

    def run(self) -> requests.Response:
        worker = threading.Thread(target=self._work, name="reward-request", daemon=True)
        worker.start()
        if not self.done.wait(self.timeout_s):
            self._abort()
            raise _Deadline(f"no complete answer within the {self.timeout_s}s deadline")
        if isinstance(self.error, requests.Timeout):
            raise _Retryable(f"timeout: {self.error}") from self.error
        if isinstance(self.error, requests.ConnectionError):
            raise _Retryable(f"connection error: {self.error}") from self.error
        if self.error is not None:
            raise self.error
        return self.response

    def _abort(self) -> None:
        """Shut the socket of a response still being read; a request still waiting for its
        headers is left to requests' per-read timeout (its thread is a daemon)."""
        sock = getattr(getattr(getattr(self.response, "raw", None), "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def token_sent_in_clear(url: str) -> bool:
    """True when `url` is plain http to a host other than this machine (loopback)."""
    parsed = urlparse(url)
    if parsed.scheme != "http":
        return False
    host = parsed.hostname or ""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def _plain(values: Any) -> list[Any]:
    """JSON-safe list: strings stay, None stays, anything else becomes its str()."""
    return [v if v is None or isinstance(v, str) else str(v) for v in values]
