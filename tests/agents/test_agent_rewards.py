"""What the rewards see of a multi-turn episode (docs/agents.md): `reward.kind=env` passes the
environment's rewards on with `reward/acc` and `reward/return`; with tools and no environment a rule
function reads the model's turns as one text, a reward model scores the whole conversation, and a
remote service gets the first prompt and the model's tokens only. Episodes are built by hand (no
engine) and turned into rows as a rollout does."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from raygraph.agents.episode import Episode
from raygraph.batch import (
    GROUND_TRUTH,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_TEXT,
    RESPONSE_MASK,
    TOKEN_LEVEL_SCORES,
    UID,
    Batch,
)
from raygraph.graph.step_metrics import rollout_metrics, validation_metrics
from raygraph.models.tiny import build_tiny_tokenizer
from raygraph.workers.agent_rollout import episode_rows
from raygraph.workers.reward_env import EnvRewardWorker
from raygraph.workers.reward_model import RewardModelWorker
from raygraph.workers.reward_remote import RemoteRewardWorker
from raygraph.workers.reward_rule import RuleRewardWorker

TOK = build_tiny_tokenizer()   # one token per character; <|end|> is also the eos
PROMPTS = ["<|user|>What is 12*3?<|end|><|assistant|>", "<|user|>What is 3+4?<|end|><|assistant|>",
           "<|user|>What is 9-1?<|end|><|assistant|>"]
# Each episode: (model turn, what the environment or tool answered, reward after that turn), ...
# Episode 0 calls a tool, then answers; episodes 1 and 2 answer at once.
EPISODES = [
    [("calc(12*3)", "<|end|><|user|>result 36<|end|><|assistant|>", -0.5), ("#### 36", None, 1.0)],
    [("#### 7", None, 0.0)],
    [("#### 9", None, -1.0)],
]
MODEL_TEXTS = ["calc(12*3)#### 36", "#### 7", "#### 9"]   # the model's turns, eos skipped, joined


def _ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


def _rows() -> Batch:
    """Three episodes as rollout rows (responses: model turns and tool results, mask: the model's)."""
    episodes = []
    for index, (prompt, turns) in enumerate(zip(PROMPTS, EPISODES)):
        ep = Episode(index=index, prompt=_ids(prompt), seed=0, uid=f"u{index}")
        for text, answer, reward in turns:
            tokens = _ids(text) + [TOK.eos_token_id]
            ep.add_model_turn(tokens, [-0.25] * len(tokens), text)
            ep.add_reward(reward)
            if answer is not None:
                shown = _ids(answer)
                ep.add_messages(shown, [{"role": "tool", "text": "result 36", "tokens": len(shown), "reward": 0.0}])
        ep.finish("none")
        ep.check()
        episodes.append(ep)
    prompt_ids = [torch.tensor(_ids(p)) for p in PROMPTS]
    width = max(len(p) for p in prompt_ids)
    ids = torch.stack([torch.cat([torch.full((width - len(p),), TOK.pad_token_id), p]) for p in prompt_ids])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.int64), torch.ones_like(p)])
                        for p in prompt_ids])
    rows = Batch({PROMPT_IDS: ids, PROMPT_MASK: mask},
                 {PROMPT_TEXT: PROMPTS, GROUND_TRUTH: MODEL_TEXTS, UID: ["u0", "u1", "u2"]})
    return episode_rows(rows, episodes, TOK, weight_version=0)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("char_tokenizer")
    TOK.save_pretrained(path)
    return str(path)


def test_env_reward_reports_acc_and_return_of_each_episode():
    rows = _rows()
    out = EnvRewardWorker().score(rows)
    assert torch.equal(out[TOKEN_LEVEL_SCORES], rows["env_scores"])   # where the environment gave them
    # returns: -0.5 + 1.0 = 0.5, 0.0, -1.0; acc is 1 only for a return > 0 (a return of 0 is no success)
    assert out["reward_extra.return"].tolist() == [0.5, 0.0, -1.0]
    assert out["reward_extra.acc"].tolist() == [1.0, 0.0, 0.0]
    metrics = rollout_metrics(rows.union(out))
    assert metrics["reward/acc"] == pytest.approx(1 / 3)
    assert metrics["reward/return"] == pytest.approx((0.5 + 0.0 - 1.0) / 3)   # -1/6
    assert metrics["reward/mean"] == pytest.approx(-1 / 6)
    assert validation_metrics(rows.union(out))["val/accuracy"] == pytest.approx(1 / 3)


EXACT = '''
from raygraph.rewards.registry import RewardResult


def exact(response_text, ground_truth, extra_info):
    return RewardResult(float(response_text == ground_truth), {"chars": len(response_text)})
'''


def test_a_rule_reward_reads_the_model_turns_as_one_text_without_the_tool_results(tokenizer_path, tmp_path):
    (tmp_path / "exact.py").write_text(EXACT)
    rows = _rows()
    out = RuleRewardWorker(tokenizer_path, function=f"{tmp_path / 'exact.py'}:exact").score(rows)
    # the ground truths are the model's texts: every row matches, and "result 36" was not read
    assert out[TOKEN_LEVEL_SCORES].sum(-1).tolist() == [1.0, 1.0, 1.0]
    assert out["reward_extra.chars"].tolist() == [17.0, 6.0, 6.0]   # len("calc(12*3)#### 36"), len("#### 7")


def _recording_service(bodies: list) -> ThreadingHTTPServer:
    """A reward service on 127.0.0.1 that scores each response by its length and keeps every request body."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            data = json.dumps({"scores": [float(len(r)) for r in body["responses"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def test_a_remote_reward_gets_the_first_prompt_and_the_model_tokens_only(tokenizer_path):
    bodies: list = []
    server = _recording_service(bodies)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        out = RemoteRewardWorker(url, tokenizer_path, timeout_s=10, max_retries=0).score(_rows())
    finally:
        server.shutdown()
        server.server_close()
    [body] = bodies
    assert body["prompts"] == PROMPTS                # the first prompt: no tool result, no later turn
    assert body["responses"] == MODEL_TEXTS          # the model's tokens only
    assert out[TOKEN_LEVEL_SCORES].sum(-1).tolist() == [17.0, 6.0, 6.0]


def test_a_reward_model_scores_the_whole_conversation_tool_results_included(tiny_rm_path):
    rows = _rows()
    out = RewardModelWorker(model_path=tiny_rm_path).score(rows)
    # episode 0 as the reward model reads it: the prompt, both model turns and the tool's answer between them
    conversation = PROMPTS[0] + "calc(12*3)<|end|><|end|><|user|>result 36<|end|><|assistant|>#### 36<|end|>"
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_rm_path)
    with torch.no_grad():
        whole, model_only = (float(rm(input_ids=torch.tensor([_ids(text)])).logits[0, 0])
                             for text in (conversation, PROMPTS[0] + "calc(12*3)<|end|>#### 36<|end|>"))
    assert whole != pytest.approx(model_only, abs=1e-4)   # the tool result changes the score
    scores = out[TOKEN_LEVEL_SCORES][0]
    last = int(rows[RESPONSE_MASK][0].nonzero().max())     # the score sits on the model's last token
    assert float(scores[last]) == pytest.approx(whole, abs=1e-5)
    assert float(scores.sum()) == pytest.approx(whole, abs=1e-5)   # and nowhere else

