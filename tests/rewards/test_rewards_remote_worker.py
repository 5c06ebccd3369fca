"""RemoteRewardWorker against a local HTTP server on 127.0.0.1 (run in a thread)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoTokenizer

from raygraph.batch import TOKEN_LEVEL_SCORES, UID
from raygraph.rewards.batching import NonFiniteRewardError
from raygraph.workers.reward_remote import RemoteRewardWorker, token_sent_in_clear


class _Service:
    """Scripted answers: each request pops the next behaviour ("ok", "hang", "503", "short")."""

    def __init__(self, script):
        self.script, self.requests, self.release = list(script), [], threading.Event()

    def handle(self, handler):
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        self.requests.append({"body": body, "auth": handler.headers.get("Authorization")})
        action = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if action == "hang":               # held until the test ends: the client times out
            self.release.wait(timeout=10)
            return
        if action == "503":
            handler.send_response(503)
            handler.end_headers()
            handler.wfile.write(b"overloaded")
            return
        n = len(body["responses"]) - (1 if action == "short" else 0)
        answer = {"scores": [float(len(r)) for r in body["responses"]][:n],
                  "extras": {"is_seven": [float(r == "7") for r in body["responses"]][:n]}}
        if action in _BAD_SECOND_SCORE:
            answer["scores"][1] = _BAD_SECOND_SCORE[action]
        data = json.dumps(answer).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if action == "drip":               # one byte every 0.2 s: each read is quick, the whole is not
            for byte in data:
                if self.release.wait(timeout=0.2):
                    return
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
            return
        handler.wfile.write(data)


_BAD_SECOND_SCORE = {"nan": float("nan"), "inf": float("inf"), "string": "0.5", "null": None}


@pytest.fixture
def serve():
    servers = []

    def start(*script):
        service = _Service(script)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                service.handle(self)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append((server, service))
        return f"http://127.0.0.1:{server.server_address[1]}/score", service

    yield start
    for server, service in servers:
        service.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def batch(tokenizer_path, make_response_batch):
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    out = make_response_batch(tok, ["7", "123", ""], ["7", "9", "1"], ["toy_arith", "gsm8k", "toy_arith"])
    return out.with_columns(**{UID: ["u0", "u1", "u2"]})


def test_success_protocol_auth_and_placement(serve, batch, tokenizer_path, monkeypatch):
    url, service = serve("ok")
    monkeypatch.setenv("RM_TOKEN", "s3cret")
    out = RemoteRewardWorker(url, tokenizer_path, timeout_s=2, auth_env="RM_TOKEN").score(batch)
    sent = service.requests[0]
    assert sent["auth"] == "Bearer s3cret"
    assert sent["body"] == {"prompts": [f"<|user|>q{i}<|end|><|assistant|>" for i in range(3)],
                            "responses": ["7", "123", ""], "ground_truths": ["7", "9", "1"],
                            "data_sources": ["toy_arith", "gsm8k", "toy_arith"]}
    scores = out[TOKEN_LEVEL_SCORES]
    expected = torch.zeros_like(scores)
    expected[0, 1], expected[1, 3] = 1.0, 3.0     # score = len(text), on the eos token
    assert torch.equal(scores, expected)          # the empty response holds no score
    assert out["reward_extra.is_seven"].tolist() == [1.0, 0.0, 0.0]


def test_timeout_then_retry_succeeds(serve, batch, tokenizer_path):
    url, service = serve("hang", "ok")
    start = time.monotonic()
    out = RemoteRewardWorker(url, tokenizer_path, timeout_s=0.3, max_retries=2, backoff_s=0.01).score(batch)
    assert len(service.requests) == 2 and out[TOKEN_LEVEL_SCORES][0, 1].item() == 1.0
    assert time.monotonic() - start < 3


def test_permanent_failure_names_url_and_attempts(serve, batch, tokenizer_path):
    url, service = serve("503")
    worker = RemoteRewardWorker(url, tokenizer_path, timeout_s=1, max_retries=2, backoff_s=0.01)
    with pytest.raises(RuntimeError, match=rf"reward service {url} failed after 3 attempts.*HTTP 503"):
        worker.score(batch)
    assert len(service.requests) == 3


def test_connection_refused_and_length_mismatch(serve, batch, tokenizer_path):
    url, _ = serve("short")
    with pytest.raises(RuntimeError, match=rf"{url} returned 2 scores for 3 rows"):
        RemoteRewardWorker(url, tokenizer_path, timeout_s=1).score(batch)
    with socket.socket() as s:          # a port that was free a moment ago: nothing listens
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    with pytest.raises(RuntimeError, match=rf"{dead} failed after 2 attempts.*connection error"):
        RemoteRewardWorker(dead, tokenizer_path, timeout_s=0.5, max_retries=1, backoff_s=0.01).score(batch)


def test_missing_auth_variable_fails_at_construction(tokenizer_path, monkeypatch):
    monkeypatch.delenv("RM_TOKEN_UNSET", raising=False)
    with pytest.raises(ValueError, match="RM_TOKEN_UNSET"):
        RemoteRewardWorker("http://127.0.0.1:9/x", tokenizer_path, auth_env="RM_TOKEN_UNSET")


def test_timeout_is_a_total_deadline_against_a_dripping_server(serve, batch, tokenizer_path):
    # before: timeout_s was per socket read, so a server dripping a byte every 0.2 s kept one
    # request going for the length of the body (~110 bytes = 22 s here, 221 s in the report)
    url, service = serve("drip")
    worker = RemoteRewardWorker(url, tokenizer_path, timeout_s=0.5, max_retries=1, backoff_s=0.01)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed after 2 attempts \(deadline 0.5s each\).*0.5s deadline"):
        worker.score(batch)
    assert time.monotonic() - start < 0.5 * 2 + 1.0
    assert len(service.requests) == 2


@pytest.mark.parametrize("action, shown", [("string", "'0.5' (str)"), ("null", "None (NoneType)")])
def test_string_or_null_score_names_the_service_and_row(serve, batch, tokenizer_path, action, shown):
    url, _ = serve(action)
    with pytest.raises(TypeError, match=rf"reward service {url} returned {re.escape(shown)} as the score "
                                        r"of row 1 \(uid 'u1'\)"):
        RemoteRewardWorker(url, tokenizer_path, timeout_s=2).score(batch)


@pytest.mark.parametrize("action", ["nan", "inf"])
def test_non_finite_score_fails_by_default_naming_service_and_uid(serve, batch, tokenizer_path, action):
    url, _ = serve(action)
    with pytest.raises(NonFiniteRewardError, match=rf"reward service {url} returned a non-finite score for "
                                                   r"1 of 3 samples: row 1 \(uid 'u1'\)"):
        RemoteRewardWorker(url, tokenizer_path, timeout_s=2).score(batch)


def test_non_finite_score_zeroed_and_counted_when_asked(serve, batch, tokenizer_path, caplog):
    url, _ = serve("nan")
    out = RemoteRewardWorker(url, tokenizer_path, timeout_s=2, on_non_finite="zero").score(batch)
    assert out[TOKEN_LEVEL_SCORES].sum(dim=1).tolist() == [1.0, 0.0, 0.0]   # row 1's NaN -> 0
    assert out["reward_extra.non_finite"].tolist() == [0.0, 1.0, 0.0]     # reward/non_finite = 1/3
    assert "uid 'u1'" in caplog.text


@pytest.mark.parametrize("url, clear", [("http://rm.example.com/score", True), ("http://10.0.0.5:80/s", True),
                                        ("https://rm.example.com/score", False), ("http://127.0.0.1:9/s", False),
                                        ("http://localhost:8000/s", False), ("http://[::1]:9/s", False)])
def test_bearer_token_over_plain_http_to_another_host_is_flagged(url, clear):
    assert token_sent_in_clear(url) is clear


@pytest.mark.parametrize("url, auth_env, warned", [("http://rm.example.com/score", "RM_TOKEN", True),
                                                   ("https://rm.example.com/score", "RM_TOKEN", False),
                                                   ("http://rm.example.com/score", None, False)])
def test_a_bearer_token_over_plain_http_is_warned_about_once_at_start(url, auth_env, warned, tokenizer_path,
                                                                      monkeypatch, caplog):
    monkeypatch.setenv("RM_TOKEN", "s3cret")
    RemoteRewardWorker(url, tokenizer_path, auth_env=auth_env)   # no request is made at start
    expected = [f"reward service {url}: the bearer token from $RM_TOKEN goes over plain http to a host that is "
                "not this machine; anyone on the path can read it (use https)"] if warned else []
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == expected


def test_retries_wait_backoff_s_doubled_each_time(serve, batch, tokenizer_path, monkeypatch):
    """Module docstring: retry k sleeps `backoff_s * 2**k`; 3 retries of 0.5 s wait 0.5, 1 and 2 s."""
    import raygraph.workers.reward_remote as remote

    waits = []
    monkeypatch.setattr(remote, "time", type("Clock", (), {"sleep": staticmethod(waits.append)}))
    url, service = serve("503", "503", "503", "ok")
    out = RemoteRewardWorker(url, tokenizer_path, timeout_s=2, max_retries=3, backoff_s=0.5).score(batch)
    assert (waits, len(service.requests)) == ([0.5, 1.0, 2.0], 4)
    assert out[TOKEN_LEVEL_SCORES][0, 1].item() == 1.0   # the 4th attempt's answer
