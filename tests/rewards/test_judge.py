"""An LLM judge as the reward (`reward.kind=judge`): prompts from templates, verdicts parsed into
numbers, the answer an episode ends with, failures under `on_error`, the composition with rule
functions, and the judge's prompts and outputs in the dumps. The tiny random model judges here
(what it says does not matter: a parser that reads a number from any text makes every verdict
a known number); SmolLM2 judging is in tests/test_real_model.py."""

from __future__ import annotations

import pytest
import torch
from conftest import response_batch

from raygraph.batch import (
    JUDGE_OUTPUT,
    JUDGE_PROMPT,
    PROMPT_MESSAGES,
    REWARD_EXTRA_PREFIX,
    TOKEN_LEVEL_SCORES,
    UID,
)
from raygraph.graph.step_metrics import sample_records
from raygraph.rewards.judge import final_answer_ids, make_parser, make_template, question_of

LENGTH_PARSER = '''
def verdict(text):
    """A number read from any output of a random model: its characters' codes summed, mod 7."""
    return float(sum(map(ord, text)) % 7)
'''


def _verdict(text: str) -> float:   # what the parser above reads
    return float(sum(map(ord, text)) % 7)


def test_templates_fill_the_fields_and_name_an_unknown_one():
    fields = {"question": "2+2?", "prompt": "<u>2+2?", "response": "4", "ground_truth": "4"}
    assert make_template("Q: {question} A: {response} ({ground_truth})")(fields) == "Q: 2+2? A: 4 (4)"
    assert make_template("Q: {{ question }} A: {{ response }}", "jinja")(fields) == "Q: 2+2? A: 4"
    with pytest.raises(ValueError, match=r"\['answer'\].*the fields are"):
        make_template("Rate {answer}")
    with pytest.raises(ValueError, match=r"\['answer'\]"):
        make_template("Rate {{ answer }}", "jinja")
    with pytest.raises(ValueError, match="positional field"):
        make_template("Rate {} {response}")


def test_parsers_read_the_number_or_nothing(tmp_path):
    first = make_parser(r"(-?\d+(?:\.\d+)?)")
    assert first("I give it 7.5 out of 10") == 7.5 and first("-3") == -3.0 and first("no idea") is None
    assert make_parser(r"Score: (\d+)")("Reasoning 1 2 3. Score: 8") == 8.0   # a pattern with a colon
    assert make_parser(r"\d+")("x 42 y") == 42.0                               # no group: the whole match
    assert make_parser(r"Score: (\d+)|(\d+)/10")("8/10") == 8.0               # the first group that matched
    code = tmp_path / "parse.py"
    code.write_text("def parse(text):\n    return None if 'bad' in text else {'yes': 1, 'no': 0}.get(text.strip())\n")
    parse = make_parser(f"{code}:parse")
    assert parse(" yes") == 1.0 and parse("no") == 0.0 and parse("bad") is None and parse("maybe") is None


def test_the_answer_judged_is_the_last_model_turn():
    response = torch.tensor([5, 6, 7, 8, 9, 10, 11, 0])
    multi_turn = torch.tensor([1, 1, 0, 0, 1, 1, 0, 0])   # model, env feedback, model, pad
    assert final_answer_ids(response, multi_turn) == [9, 10]
    assert final_answer_ids(response, torch.tensor([1, 1, 1, 0, 0, 0, 0, 0])) == [5, 6, 7]
    assert final_answer_ids(response, torch.zeros(8, dtype=torch.long)) == []
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert question_of(chat, "<|user|>2+2?") == "2+2?" and question_of(None, "raw prompt") == "raw prompt"


def _judge(tiny_model_path, tmp_path, **kwargs):
    from raygraph.workers.reward_judge import JudgeRewardWorker

    code = tmp_path / "length_parser.py"
    code.write_text(LENGTH_PARSER)
    args = {"parser": f"{code}:verdict", "max_new_tokens": 6, "template": "Judge: {question} -> {response}",
            "chat": False, **kwargs}   # as raw text the random model's verdicts differ (through its chat template all are empty)
    return JudgeRewardWorker(model_path=tiny_model_path, tokenizer_path=tiny_model_path, **args)


def _rows(tiny_model_path):
    from raygraph.models.loading import load_tokenizer

    batch = response_batch(load_tokenizer(tiny_model_path), ["12", "7", "", "30"], ["12", "8", "1", "30"],
                           ["toy_arith"] * 4)
    return batch.with_columns(**{UID: ["a", "a", "b", "b"],
                                 PROMPT_MESSAGES: [[{"role": "user", "content": f"q{i}"}] for i in range(4)]})


def test_the_judges_verdicts_are_the_scores_and_reach_the_dumps(tiny_model_path, tmp_path):
    judge = _judge(tiny_model_path, tmp_path, weight=0.5)
    out = _rows(tiny_model_path).union(judge.score(_rows(tiny_model_path)))
    outputs = list(out[JUDGE_OUTPUT])
    verdicts = [_verdict(t) for t in outputs]
    assert len({verdicts[0], verdicts[1], verdicts[3]}) > 1, "equal verdicts would prove little"
    assert outputs[2] == "" and out[JUDGE_PROMPT][2] == ""          # an empty answer is not judged (score 0)
    assert [p for k, p in enumerate(out[JUDGE_PROMPT]) if k != 2] == ["Judge: q0 -> 12", "Judge: q1 -> 7",
                                                                      "Judge: q3 -> 30"]
    assert out[TOKEN_LEVEL_SCORES].sum(-1).tolist() == pytest.approx([0.5 * v for v in verdicts])
    assert out[REWARD_EXTRA_PREFIX + "judge/mean"].tolist() == pytest.approx(verdicts)
    assert out[REWARD_EXTRA_PREFIX + "judge_unparsed"].tolist() == [0.0] * 4
    # on the last response token, like every reward
    last = out["response_mask"].sum(-1) - 1
    assert out[TOKEN_LEVEL_SCORES][0, last[0]] == pytest.approx(0.5 * verdicts[0])
    records = sample_records(out)
    assert [r[JUDGE_OUTPUT] for r in records] == outputs and records[0][JUDGE_PROMPT] == "Judge: q0 -> 12"
    assert [r["judge/mean"] for r in records] == pytest.approx(verdicts)


def test_an_empty_batch_is_scored_without_calling_the_judge(tiny_model_path, tmp_path):
    out = _judge(tiny_model_path, tmp_path).score(_rows(tiny_model_path).select([]))
    assert len(out) == 0 and out[TOKEN_LEVEL_SCORES].shape[0] == 0 and list(out[JUDGE_OUTPUT]) == []


def test_an_answer_of_only_special_tokens_is_not_judged(tiny_model_path, tmp_path):
    from raygraph.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_path)
    batch = response_batch(tok, ["", "7"], ["1", "7"], ["toy_arith"] * 2)
    batch.tensors["responses"][0, 0] = tok.eos_token_id   # a response of one end-of-turn token
    batch.tensors["response_mask"][0, 0] = 1
    out = _judge(tiny_model_path, tmp_path).score(batch)
    assert list(out[JUDGE_PROMPT]) == ["", "Judge: <|user|>q1<|end|><|assistant|> -> 7"]
    assert out[TOKEN_LEVEL_SCORES][0].abs().sum() == 0 and out[REWARD_EXTRA_PREFIX + "judge/mean"][0] == 0


def test_a_rule_function_may_not_take_the_judges_columns(tiny_model_path, tmp_path):
    judge = _judge(tiny_model_path, tmp_path, functions=[{"function": "toy_arith", "name": "judge"}])
    with pytest.raises(ValueError, match=r"\['judge/mean'\], which are the judge's own columns"):
        judge.score(_rows(tiny_model_path))


def test_rule_functions_add_to_the_verdict(tiny_model_path, tmp_path):
    judge = _judge(tiny_model_path, tmp_path, weight=1.0,
                   functions=[{"function": "toy_arith", "weight": 2.0, "name": "arith"}])
    out = judge.score(_rows(tiny_model_path))
    verdicts = [_verdict(t) for t in out[JUDGE_OUTPUT]]
    arith = [1.0, 0.0, 0.0, 1.0]   # "12" == 12, "7" != 8, empty, "30" == 30
    assert out[TOKEN_LEVEL_SCORES].sum(-1).tolist() == pytest.approx([v + 2 * a for v, a in zip(verdicts, arith)])
    assert out[REWARD_EXTRA_PREFIX + "arith/mean"].tolist() == arith


def test_an_unreadable_verdict_fails_the_step_or_scores_zero_and_is_counted(tiny_model_path, tmp_path):
    from raygraph.workers.reward_judge import JudgeFailed

    never = r"VERDICT=(\d+)"   # the random judge never writes this
    with pytest.raises(JudgeFailed, match=r"row 0 \(uid 'a'\): no number in its output .*and 2 more rows.*on_error=zero"):
        _judge(tiny_model_path, tmp_path, parser=never).score(_rows(tiny_model_path))
    out = _judge(tiny_model_path, tmp_path, parser=never, on_error="zero").score(_rows(tiny_model_path))
    assert out[TOKEN_LEVEL_SCORES].abs().sum() == 0
    assert out[REWARD_EXTRA_PREFIX + "judge_unparsed"].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_config_needs_the_judge_and_reaches_the_worker(tiny_model_path, tmp_path):
    from raygraph.config import ConfigError, load_config
    from raygraph.run.role_specs import _reward_args

    base = ["model.path=" + tiny_model_path, "model.tiny=null", f"trainer.output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="reward.kind='judge' needs reward.judge.model_path"):
        load_config("configs/grpo_toy.yaml", [*base, "reward.kind=judge"])
    with pytest.raises(ConfigError, match="reward.judge applies to reward.kind=judge only"):
        load_config("configs/grpo_toy.yaml", [*base, f"reward.judge.model_path={tiny_model_path}"])
    judge = ["reward.kind=judge", f"reward.judge.model_path={tiny_model_path}"]
    with pytest.raises(ConfigError, match=r"\['answer'\], which are not fields"):
        load_config("configs/grpo_toy.yaml", [*base, *judge, "reward.judge.template='Rate {answer}'"])
    with pytest.raises(ConfigError, match="neither file.py:fn nor a valid regular expression"):
        load_config("configs/grpo_toy.yaml", [*base, *judge, "reward.judge.parser='(unclosed'"])
    with pytest.raises(ConfigError, match="the name 'judge' is the judge's own metric"):
        load_config("configs/grpo_toy.yaml", [*base, *judge, "reward.functions=[{function: toy_arith, name: judge}]"])
    cfg = load_config("configs/grpo_toy.yaml", [*base, "reward.kind=judge", f"reward.judge.model_path={tiny_model_path}",
                                                "reward.judge.weight=0.25", "reward.judge.engine=vllm",
                                                "reward.on_error=zero",
                                                "reward.functions=[{function: toy_arith, weight: 2.0}]"])
    args = _reward_args(cfg)
    assert args["model_path"] == tiny_model_path and args["weight"] == 0.25 and args["engine"] == "vllm"
    assert args["on_error"] == "zero" and args["functions"][0]["weight"] == 2.0
    assert args["tokenizer_path"] == tiny_model_path


@pytest.mark.slow
def test_a_run_trains_on_the_verdicts_of_a_vllm_judge(tiny_model_path, tmp_path, ray_local):
    """`raygraph train` with `reward.kind=judge` (a vLLM engine judging in the reward actor, plus a
    weighted rule function): every dumped sample's score is 0.5 x its verdict + the rule term, and
    its advantage is GRPO's of those scores within its prompt group."""
    import json

    import numpy as np

    from raygraph.config import load_config
    from raygraph.run.trainer import run

    code = tmp_path / "length_parser.py"
    code.write_text(LENGTH_PARSER)
    cfg = load_config("configs/grpo_toy.yaml", [
        f"model.path={tiny_model_path}", "model.tiny=null", f"trainer.output_dir={tmp_path}", "logging.mlflow=false",
        f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'data' / 'val.parquet'}]",
        "trainer.total_steps=2", "trainer.dump_rollouts=1", "reward.kind=judge",
        f"reward.judge.model_path={tiny_model_path}", f"reward.judge.parser={code}:verdict", "reward.judge.weight=0.5",
        "reward.judge.engine=vllm", "reward.judge.max_new_tokens=6", "reward.judge.max_model_len=256",
        "reward.judge.gpu_memory_utilization=0.02",
        "reward.judge.chat=false", "reward.judge.template='Judge {question} -> {response}'",
        "reward.functions=[{function: toy_arith, weight: 2.0}]"])
    summary = run(cfg)
    assert summary.steps_done == 2
    metrics = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    for step in (1, 2):
        records = [json.loads(line) for line in
                   (summary.run_dir / "samples" / f"train_step_{step:06d}.jsonl").read_text().splitlines()]
        judged = [bool(r["response"].strip()) for r in records]   # an empty answer is not judged
        assert len(records) == 16 and sum(judged) > 8
        assert [r[JUDGE_PROMPT].startswith("Judge ") if j else r[JUDGE_PROMPT] == "" for r, j in zip(records, judged)] \
            == [True] * 16
        verdicts = [_verdict(r[JUDGE_OUTPUT]) if j else 0.0 for r, j in zip(records, judged)]
        assert [r["judge/mean"] for r in records] == verdicts
        assert [r["score"] for r in records] == pytest.approx(
            [0.5 * v + 2.0 * r["toy_arith/mean"] for v, r in zip(verdicts, records)])
        for uid in {r["uid"] for r in records}:
            group = [r for r in records if r["uid"] == uid]
            scores = np.array([r["score"] for r in group])
            expected = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
            assert [r["advantage"] for r in group] == pytest.approx(expected.tolist(), abs=1e-4)
        assert metrics[step - 1]["reward/judge/mean"] == pytest.approx(np.mean(verdicts))
    assert any(r["advantage"] != 0 for r in records), "equal verdicts everywhere would prove nothing"


def test_the_docs_judge_config_loads_and_reads_its_verdicts(tiny_model_path, tmp_path):
    """docs/custom-algorithm.md's judge.yaml on the toy config: a valid config whose template and
    parser work (SmolLM2 judging with them: tests/test_real_model.py)."""
    import yaml
    from doc_blocks import REPO, doc_blocks

    from raygraph.config import build_config

    data = yaml.safe_load((REPO / "configs" / "grpo_toy.yaml").read_text())
    data.update(yaml.safe_load(doc_blocks()["judge.yaml"]))
    cfg = build_config(data, [f"reward.judge.model_path={tiny_model_path}", f"trainer.output_dir={tmp_path}"])
    judged = cfg.reward.judge
    assert cfg.reward.kind == "judge" and judged.engine == "vllm" and cfg.reward.functions[0].function == "toy_arith"
    assert make_parser(judged.parser)("I would say 7 out of 10") == 7.0
    assert make_template(judged.template)({"question": "2+3=", "response": "5", "prompt": "", "ground_truth": "5"}) \
        == "Is 5 the right answer to 2+3=? Reply with a score from 0 to 10."
