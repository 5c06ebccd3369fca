"""`raygraph train` with an agent program (`configs/demo_program.yaml`) on the vLLM engine: every
dumped episode's score is what the program computes from the turns it was served, the two calls of
an episode are one row (the template's history is the engine's tokens), and each advantage is
GRPO's of those scores within its prompt group."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def _program_reward(turns: list[dict], answer: str) -> float:
    """raygraph/agents/demo_program.py's rule, read back from the dumped turns."""
    texts = [m["text"].strip() for m in turns]
    return 1.0 if texts[0] == answer.strip() else 0.5 if len(texts) == 2 and texts[1] == answer.strip() else 0.0


@pytest.mark.slow
def test_the_program_demo_trains_on_vllm_with_the_programs_rewards(tmp_path, monkeypatch, ray_local):
    pytest.importorskip("vllm")
    from raygraph.config import load_config
    from raygraph.run.trainer import run

    monkeypatch.chdir(tmp_path)   # the config's data paths are relative: written here
    cfg = load_config(str(REPO / "configs" / "demo_program.yaml"), [
        f"trainer.output_dir={tmp_path / 'out'}", "logging.mlflow=false", "rollout.engine=vllm",
        "rollout.gpu_memory_utilization=0.02", "trainer.total_steps=2", "trainer.dump_rollouts=1",
        "trainer.val_every=0", "data.prompts_per_step=8", "rollout.n=4",
        "actor.mini_batch_size=32", "actor.micro_batch_size=32"])
    summary = run(cfg)
    assert summary.steps_done == 2
    metrics = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    split = 0
    for step in (1, 2):
        records = [json.loads(line) for line in
                   (summary.run_dir / "samples" / f"train_step_{step:06d}.jsonl").read_text().splitlines()]
        episodes = _episodes(records)
        assert len(episodes) == 32
        for parts in episodes:
            turns = [m for r in parts for m in r["conversation"] if m["role"] == "assistant"]
            result = parts[-1]["conversation"][-1]
            assert result["role"] == "program" and result["retried"] == (len(turns) == 2)
            reward = _program_reward(turns, parts[0]["ground_truth"])
            assert result["reward"] == reward and [r["score"] for r in parts] == [reward] * len(parts)
            assert len({r["uid"] for r in parts}) == 1
            # a row's second turn follows its first in the row unless the history the template
            # rendered from the text is not the tokens the engine made (a special token mid-turn)
            split += len(parts) - 1
            assert parts[0]["prompt"] == parts[0]["prompt"].split("<|end|>")[0] + "<|end|><|assistant|>"
        for uid in {r["uid"] for r in records}:
            group = [r for r in records if r["uid"] == uid]
            scores = np.array([r["score"] for r in group])
            expected = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
            assert [r["advantage"] for r in group] == pytest.approx(expected.tolist(), abs=1e-4)
        turns = [sum(m["role"] == "assistant" for m in r["conversation"]) for r in records]
        assert metrics[step - 1]["agent/turns_mean"] == pytest.approx(np.mean(turns))   # per row
    assert {r["score"] for r in records} != {0.0}, "all-zero scores would prove nothing"
    print(f"episodes split into two rows: {split} of 64")


def _episodes(records: list[dict]) -> list[list[dict]]:
    """Rows in batch order, cut after each row that ends with the program's result."""
    episodes, current = [], []
    for r in records:
        current.append(r)
        if r["conversation"][-1]["role"] == "program":
            episodes.append(current)
            current = []
    assert not current
    return episodes
