"""DAPO dynamic sampling's extra generation rounds (`algorithm.dynamic_sampling.max_extra_rounds`):
by hand on batches (`dapo.refill_prompts`, `dapo.add_round`), the data order the driver keeps
(`StepData.settle`), and GRPO runs on 1 and 2 training ranks whose ledger is the data order with
nothing skipped and nothing repeated; the user example `examples/dapo_filter.py` as a user file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from raygraph.batch import (
    EXTRA_PROMPTS,
    PROMPT_BATCHES_USED,
    TOKEN_LEVEL_SCORES,
    UID,
    Batch,
    without_extra_prompts,
)
from raygraph.config import load_config
from raygraph.config.workflow_ref import load_workflow
from raygraph.data import ResumableSampler
from raygraph.graph import GraphBuildError, dapo
from raygraph.graph.report import graph_facts
from raygraph.run.feed import StepData
from raygraph.run.graphs import build_graphs

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "configs" / "grpo_toy.yaml"
ACC = "reward_extra.acc"
ROUNDS = "rollout/gen_rounds"


def _scored(uids: str, acc: list[int]) -> Batch:
    """One row per letter of `uids` (a group = equal letters), scored `acc` on its one token."""
    scores = torch.tensor(acc, dtype=torch.float32)[:, None]
    return Batch({TOKEN_LEVEL_SCORES: scores, ACC: scores[:, 0].clone(), "response_mask": torch.ones(len(acc), 1)},
                 {UID: np.array(list(uids), dtype=object)})


def _prompts(uids: str) -> Batch:
    return Batch({"prompt_ids": torch.arange(len(uids))[:, None]}, {UID: np.array(list(uids), dtype=object)})


def test_rounds_refill_the_batch_up_to_the_target_then_stop():
    # target 2 groups. Round 0: a (1,0) varies, b (1,1) does not -> 1 kept.
    prompts = _prompts("ab")
    prompts.meta.update(step=3, **{EXTRA_PROMPTS: [_prompts("cde"), _prompts("fg")]})
    kept = dapo.filter_groups(_scored("aabb", [1, 0, 1, 1]), metric="acc", max_groups=2)
    assert list(kept[UID]) == ["a", "a"] and kept.meta[PROMPT_BATCHES_USED] == 1
    # round 1 is needed: the first extra batch, with the step's meta but not the extra batches
    first = dapo.refill_prompts(prompts, kept, round=1, target=2)
    assert list(first[UID]) == ["c", "d", "e"] and first.meta == {"step": 3}
    # the first round samples from the step's prompts without the extra batches riding in their meta
    assert without_extra_prompts(prompts).meta == {"step": 3} and EXTRA_PROMPTS in prompts.meta
    # its groups c (0,1) and e (1,0) vary, d (0,0) does not: only c fits (trimmed to the target)
    kept = dapo.add_round(kept, _scored("ccddee", [0, 1, 0, 0, 1, 0]), metric="acc", target=2)
    assert list(kept[UID]) == ["a", "a", "c", "c"]
    assert {k: kept.meta[k] for k in ("groups_total", "groups_kept", PROMPT_BATCHES_USED, "sampled_rows")} == \
        {"groups_total": 5, "groups_kept": 2, PROMPT_BATCHES_USED: 2, "sampled_rows": 10}
    # round 2 is not needed: no prompts, so nothing is generated, and nothing changes
    second = dapo.refill_prompts(prompts, kept, round=2, target=2)
    assert len(second) == 0 and second.columns() == ["prompt_ids", UID]
    empty = _scored("", [])
    assert dapo.add_round(kept, empty, metric="acc", target=2) is kept
    metrics = dapo.shaping_metrics(kept)
    # 5 of the 10 sampled rows scored 1: reward/sampled_mean 0.5; 3 groups filtered
    assert metrics[ROUNDS] == 2 and metrics["reward/sampled_mean"] == 0.5
    assert metrics["rollout/groups_filtered"] == 3 and metrics["rollout/train_rows"] == 4
    with pytest.raises(ValueError, match="extra prompt batch 3 was asked for, but the driver attached 2"):
        dapo.refill_prompts(prompts, kept, round=3, target=2)


def test_an_empty_kept_batch_takes_the_next_round_whole():
    kept = dapo.filter_groups(_scored("aabb", [1, 1, 0, 0]), metric="acc", max_groups=2)
    assert len(kept) == 0
    kept = dapo.add_round(kept, _scored("ccdd", [1, 0, 0, 1]), metric="acc", target=2)
    assert list(kept[UID]) == list("ccdd") and kept.meta["groups_kept"] == 2 and kept.meta[PROMPT_BATCHES_USED] == 2
    assert kept.meta["groups_total"] == 4 and kept.meta["sampled_score"] == 4.0


class _Rows:
    """A stand-in dataset: row i is prompt `p<i>`."""

    def to_batch(self, indices):
        return Batch({}, {UID: np.array([f"p{i}" for i in indices], dtype=object)})


def test_unused_extra_batches_go_back_to_the_data_order():
    data = StepData(_Rows(), ResumableSampler(40, 4, seed=0, shuffle=False), None)
    step1 = data.next_prompts(step=1, kl_coef=0.0, extra_batches=2)
    assert [list(b[UID]) for b in step1.meta[EXTRA_PROMPTS]] == [["p4", "p5", "p6", "p7"],
                                                                      ["p8", "p9", "p10", "p11"]]
    # the step generated from its own prompts and one extra batch: both count as used
    assert data.settle(step1, 2) == [f"p{i}" for i in range(8)]
    step2 = data.next_prompts(step=2, kl_coef=0.0, extra_batches=2)
    assert list(step2[UID]) == ["p8", "p9", "p10", "p11"]            # the unused extra batch comes next
    assert data.settle(step2, 1) == ["p8", "p9", "p10", "p11"]
    assert data.sampler.state_dict()["position"] == 12               # a checkpoint resumes from here
    plain = data.next_prompts(step=3, kl_coef=0.0)                   # no extra batches: one batch, as before
    assert data.settle(plain, 1) == ["p12", "p13", "p14", "p15"]


def _step_graph(overrides: list[str]):
    cfg = load_config(TOY, overrides)
    return build_graphs(cfg, load_workflow(cfg.workflow))[0]


def test_the_extra_prompt_batches_a_step_reads_are_derived_from_its_graph():
    assert graph_facts(_step_graph([])).extra_prompt_batches == 0
    on = ["algorithm.dynamic_sampling.enabled=true"]
    assert graph_facts(_step_graph(on)).extra_prompt_batches == 2                 # max_extra_rounds' default
    assert graph_facts(_step_graph([*on, "algorithm.dynamic_sampling.max_extra_rounds=3"])).extra_prompt_batches == 3


def test_extra_rounds_are_refused_with_asynchronous_pipelining():
    pipelined = ["placement.mode=disaggregated", "placement.max_staleness=1", "algorithm.dynamic_sampling.enabled=true"]
    with pytest.raises(GraphBuildError, match="generates from 2 extra prompt batches per step"):
        _step_graph(pipelined)
    assert graph_facts(_step_graph([*pipelined, "algorithm.dynamic_sampling.max_extra_rounds=0"])).extra_prompt_batches == 0


def _run(tmp_path, monkeypatch, tiny_model_path, **overrides):
    from raygraph.run.trainer import run

    monkeypatch.chdir(tmp_path)
    base = {"model.path": tiny_model_path, "model.tiny": "null", "data.train_files": "[data/train.parquet]",
            "data.val_files": "[data/val.parquet]", "data.val_prompts": 4, "trainer.total_steps": 3,
            "trainer.output_dir": "runs", "logging.mlflow": "false", "checkpoint.save_hf": "false",
            "trainer.save_every": 0, "actor.optim.lr": 1e-3}
    cfg = load_config(TOY, [f"{k}={v}" for k, v in (base | overrides).items()])
    summary = run(cfg)
    rows = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, summary.run_dir, rows


def _data_order(cfg, batches: int) -> list[str]:
    """The first `batches` prompt batches of the config's data order, drawn without Ray."""
    data = StepData.load(cfg)
    return [uid for s in range(batches) for uid in data.next_prompts(step=s + 1, kl_coef=0.0)[UID]]


@pytest.mark.parametrize("world", [1, 2])
def test_grpo_with_extra_rounds_trains_full_batches_and_keeps_the_data_order(world, tmp_path, monkeypatch,
                                                                              tiny_model_path, ray_local):
    """The random tiny model's summed score varies within a group only through the overlong
    penalty (most groups do not vary): rounds run while the batch is short; where one fills
    early, the spare prompts it did not use go back to the data order (measured on 1 rank:
    rounds [3, 3, 2], kept groups [3, 3, 4])."""
    from raygraph.run.ledger import effective_steps

    cfg, run_dir, rows = _run(tmp_path, monkeypatch, tiny_model_path, **{
        "algorithm.dynamic_sampling": json.dumps({"enabled": True, "metric": "score", "max_extra_rounds": 2}),
        "algorithm.overlong_penalty": json.dumps({"buffer": 4, "factor": 1.0}),
        "placement.train_workers": world, "placement.rollout_workers": world})
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        rounds, kept = r[ROUNDS], r["rollout/groups_kept"]
        assert 1 <= rounds <= 3 and kept <= 4 and r["rollout/groups_total"] == 4 * rounds
        assert rounds == 3 or kept == 4          # a round runs only while the batch is short
        assert r["rollout/samples"] == 4 * kept  # the update trains the kept groups whole (n = 4)
        assert (r["actor/empty_updates"] == 1.0) == (kept == 0)
    ledger = effective_steps(run_dir)
    used = [int(r[ROUNDS]) for r in rows]
    assert [len(ledger[s]) for s in (1, 2, 3)] == [4 * u for u in used]
    # every prompt the steps generated from, in order, is the data order: none skipped, none twice
    assert [u for s in (1, 2, 3) for u in ledger[s]] == _data_order(cfg, sum(used))
    print(f"world {world}: rounds {used}, kept groups {[r['rollout/groups_kept'] for r in rows]}")


def test_the_dapo_filter_example_runs_as_a_user_file_on_two_ranks(tmp_path, monkeypatch, tiny_model_path,
                                                                  ray_local):
    workflow = shutil.copy(REPO / "examples" / "dapo_filter.py", tmp_path / "my_dapo.py")
    cfg, run_dir, rows = _run(tmp_path, monkeypatch, tiny_model_path, **{
        "workflow": f"{workflow}:build", "workflow_args.metric": "score", "trainer.total_steps": 2,
        "placement.train_workers": 2, "placement.rollout_workers": 2})
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:   # the summed score varies in a group only where the toy reward does: kept <= 4
        assert r["rollout/groups_total"] == 4 and r["rollout/train_rows"] == 4 * r["rollout/groups_kept"]
        assert (r["actor/empty_updates"] == 1.0) == (r["rollout/groups_kept"] == 0)


def test_every_role_method_passes_an_empty_batch_through(tiny_model_path, tiny_rm_path, rollout_batch):
    """An unneeded refill round sends every role a batch with no rows: each returns its columns
    with no rows, so that the gather and the round's shaping see an ordinary (empty) batch."""
    from raygraph.batch import (
        ENTROPY,
        GROUND_TRUTH,
        OLD_LOGPROBS,
        PROMPT_IDS,
        PROMPT_MASK,
        REF_LOGPROBS,
        RESPONSE_MASK,
        RESPONSES,
        VALUES,
    )
    from raygraph.workers.critic import CriticWorker
    from raygraph.workers.policy import PolicyWorker
    from raygraph.workers.reference import ReferenceWorker
    from raygraph.workers.reward_model import RewardModelWorker
    from raygraph.workers.reward_rule import RuleRewardWorker
    from raygraph.workers.rollout_hf import HFRolloutWorker

    prompts = rollout_batch(2, seed=0).select_columns([PROMPT_IDS, PROMPT_MASK]).with_columns(**{
        GROUND_TRUTH: np.array(["1", "2"], dtype=object), UID: np.array(["a", "b"], dtype=object)}).select(slice(0, 0))
    rollouts = HFRolloutWorker(model_path=tiny_model_path, n=2, max_new_tokens=4).generate(prompts)
    assert len(rollouts) == 0 and {RESPONSES, RESPONSE_MASK, "rollout_logprobs", "response_text"} <= set(
        rollouts.columns())
    scored = Batch.concat([rollouts.union(RuleRewardWorker(tokenizer_path=tiny_model_path, function="toy_arith")
                                          .score(rollouts))])
    assert len(scored) == 0 and TOKEN_LEVEL_SCORES in scored
    outputs = {OLD_LOGPROBS: PolicyWorker(model_path=tiny_model_path, lr=1e-3).logprobs(rollouts),
               REF_LOGPROBS: ReferenceWorker(model_path=tiny_model_path).logprobs(rollouts),
               VALUES: CriticWorker(model_path=tiny_model_path, lr=1e-3).values(rollouts),
               TOKEN_LEVEL_SCORES: RewardModelWorker(model_path=tiny_rm_path,
                                                     policy_tokenizer_path=tiny_model_path).score(rollouts)}
    for column, out in outputs.items():
        assert column in out and len(out) == 0, column
    assert ENTROPY in outputs[OLD_LOGPROBS]
