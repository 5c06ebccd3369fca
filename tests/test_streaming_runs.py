"""Streaming rollouts (issue 26) in runs: the driver's feed (least-loaded, k steps ahead, the data
order kept) with fake ranks, the config's rules, then real runs under Ray on CPU."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, STREAM_TAKE, UID, Batch
from raygraph.config import ConfigError, load_config
from raygraph.run.ledger import check_ledger
from raygraph.run.role_specs import WORKER_ARGS
from raygraph.run.streaming import StreamFeed

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "configs" / "toy" / "grpo_kl_loss.yaml"   # disaggregated: policy+reference | rollout+reward


# --- the driver's feed, with fake ranks ------------------------------------------------------------
class _Sampler:
    """Prompts 0, 1, 2, ... in order, `size` a batch (a resumable sampler's interface)."""

    def __init__(self, size: int):
        self.size, self.position = size, 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


@dataclasses.dataclass
class _Data:
    sampler: _Sampler

    def next_prompts(self, *, step: int, kl_coef: float) -> Batch:
        first = self.sampler.position
        self.sampler.position += self.sampler.size
        uids = [f"u{i}" for i in range(first, first + self.sampler.size)]
        ids = torch.ones(len(uids), 2, dtype=torch.long)
        return Batch({PROMPT_IDS: ids, PROMPT_MASK: ids.clone()}, {UID: uids}, {"step": step})


class _Ranks:
    """Fake rollout ranks: each holds what it was submitted; rank 1 starts busier."""

    def __init__(self, loads: list[int]):
        self.loads, self.held, self.waits = list(loads), [[] for _ in loads], []
        self.world_size = len(loads)

    def call(self, method: str):
        assert method == "stream_load"
        return list(self.loads)

    def call_each(self, method: str, per_rank: list[tuple]):
        if method == "stream_submit":
            for rank, (prompts,) in enumerate(per_rank):
                self.held[rank] += list(prompts[UID])
                self.loads[rank] += 2 * len(prompts)
            return [{}] * self.world_size
        assert method == "stream_wait"
        self.waits.append([list(uids) for uids, _ in per_rank])
        return [{"ready": 1.0, "busy_s": 1.0, "wall_s": 4.0, "in_flight": 2.0, "queued": 3.0, "tokens_v5": 7.0}
                for _ in per_rank]


def test_the_feed_submits_k_steps_ahead_least_loaded_and_hands_each_step_its_own_groups():
    data, ranks = _Data(_Sampler(3)), _Ranks([0, 4])   # rank 1 already has 4 samples to generate
    feed = StreamFeed(ranks, data, ahead=2, n=2, next_step=1, last_step=5, timeout_s=10)
    assert feed.fill(1) == {"stream/submitted_groups": 9.0}   # steps 1, 2, 3
    assert data.sampler.position == 0   # the run's sampler is untouched: it draws each step itself
    # least loaded, group by group (n=2 samples each; a tie goes to the lower rank), loads read
    # again before each step's prompts: [0, 4] -> u0, u1, u2 to rank 0 -> [6, 4] -> u3 to 1, u4 to
    # 0, u5 to 1 -> [8, 8] -> u6 to 0, u7 to 1, u8 to 0
    assert ranks.held == [["u0", "u1", "u2", "u4", "u6", "u8"], ["u3", "u5", "u7"]]
    prompts = data.next_prompts(step=1, kl_coef=0.0)
    figures = feed.take(1, prompts)
    assert prompts.meta[STREAM_TAKE] == {0: ["u0", "u1", "u2"], 1: []}
    assert ranks.waits == [[["u0", "u1", "u2"], []]]
    assert figures["stream/rollout_busy_frac"] == 0.25 and figures["stream/queued_groups"] == 6 - 3
    assert figures["stream/tokens_newest_version"] == 14.0
    assert feed.fill(2) == {"stream/submitted_groups": 3.0}   # only step 4 is new
    assert feed.fill(2) == {"stream/submitted_groups": 0.0}
    assert feed.fill(4) == {"stream/submitted_groups": 3.0}   # step 5, the last: nothing beyond it
    with pytest.raises(RuntimeError, match="diverged"):
        feed.take(3, data.next_prompts(step=3, kl_coef=0.0))   # step 2's prompts, presented as step 3's


def test_streaming_settings_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="placement.max_staleness=3 needs rollout.streaming=true"):
        load_config(TOY, ["placement.max_staleness=3"])
    with pytest.raises(ConfigError, match="rollout.streaming=true needs placement.mode=disaggregated"):
        load_config(REPO / "configs" / "grpo_toy.yaml", ["rollout.streaming=true", f"trainer.output_dir={tmp_path}"])
    multiturn = [f"trainer.output_dir={tmp_path}", "rollout.streaming=true", "placement.mode=disaggregated",
                 "actor.old_logprobs=auto"]
    assert load_config(REPO / "configs" / "demo_multiturn.yaml", multiturn).rollout.streaming   # episodes stream
    with pytest.raises(ConfigError, match="rollout.streaming=true needs rollout.agent.dispatch=even"):
        load_config(REPO / "configs" / "demo_multiturn.yaml", [*multiturn, "rollout.agent.dispatch=least_loaded"])
    with pytest.raises(ConfigError, match="rollout.streaming=true needs rollout.agent.env_hosts=0"):
        load_config(REPO / "configs" / "demo_multiturn.yaml", [*multiturn, "rollout.agent.env_hosts=1"])
    with pytest.raises(ConfigError, match="rollout.streaming=true needs rollout.agent.program=null"):
        load_config(REPO / "configs" / "demo_program.yaml", multiturn)
    cfg = load_config(TOY, ["rollout.streaming=true", "placement.max_staleness=4"])   # any k with streaming
    assert cfg.placement.max_staleness == 4
    assert WORKER_ARGS["rollout"](cfg, "rollout")["partial_rollouts"] is True
    cfg = load_config(TOY, ["rollout.streaming=true", "rollout.partial_rollouts=false"])
    assert WORKER_ARGS["rollout"](cfg, "rollout")["partial_rollouts"] is False


def test_a_workflow_whose_graph_does_not_take_streamed_rollouts_is_refused(tmp_path):
    from raygraph.config.workflow_ref import load_workflow
    from raygraph.graph.builder import GraphBuildError
    from raygraph.run.graphs import build_graphs

    cfg = load_config(REPO / "configs" / "toy" / "ppo.yaml", [f"trainer.output_dir={tmp_path}", "rollout.streaming=true",
                                                              "placement.mode=disaggregated", "logging.mlflow=false"])
    with pytest.raises(GraphBuildError, match="does not take streamed rollouts"):
        build_graphs(cfg, load_workflow(cfg.workflow))


# --- real runs under Ray ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from raygraph.models.tiny import build_tiny_lm

    root = tmp_path_factory.mktemp("assets")
    return {"model": build_tiny_lm(root / "tiny-lm"), "data": root / "toy"}


def _overrides(assets, out_dir: Path, **extra) -> list[str]:
    data = assets["data"]
    overrides = {"model.path": assets["model"], "model.tiny": "null", "data.train_files": f"[{data / 'train.parquet'}]",
                 "data.val_files": f"[{data / 'val.parquet'}]", "trainer.output_dir": out_dir,
                 "logging.mlflow": "false", "data.val_prompts": 8, **extra}
    return [f"{k}={v}" for k, v in overrides.items()]


# k=2 over two rollout ranks; an entropy bonus moves the policy although every reward is 0 (a
# random tiny model), so older weights really sampled differently
STREAM = {"rollout.streaming": "true", "placement.max_staleness": 2, "placement.rollout_workers": 2,
          "actor.entropy_coef": 0.5, "actor.optim.lr": 0.01, "run_name": "stream", "trainer.save_every": 2,
          "trainer.total_steps": 4, "checkpoint.save_hf": "false", "rollout.max_new_tokens": 12}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _data_order(cfg, steps) -> dict[int, list[str]]:
    """The prompts a synchronous run trains at each step, computed without Ray."""
    from raygraph.run.feed import StepData

    data = StepData.load(cfg)
    order = {s: list(data.next_prompts(step=s, kl_coef=0.0)[UID]) for s in range(1, max(steps) + 1)}
    return {s: order[s] for s in steps}


# The module's streaming run: 6 steps, a checkpoint each, and a rollout rank killed (kill -9) once
# step 2 has trained, with the next steps' groups generating on it. The lead of k steps is built
# up again by step 5 after the run-level recovery.
STREAM_STEPS = 6


@pytest.fixture(scope="module")
def stream_run(assets, tmp_path_factory, ray_local):
    from killer import Killer

    from raygraph.run.trainer import run

    out = tmp_path_factory.mktemp("stream")
    cfg = load_config(TOY, _overrides(assets, out, **{**STREAM, "trainer.total_steps": STREAM_STEPS,
                                                      "trainer.save_every": 1, "checkpoint.keep_last": 0,
                                                      "trainer.max_restarts": 1, "trainer.resume": "auto"}))
    killer = Killer(out / cfg.experiment / "stream", f"{cfg.experiment}/stream/", "rollout", after_step=2)
    summary = run(cfg)
    return cfg, summary, killer


def test_a_streaming_run_trains_the_data_order_within_k_versions(stream_run):
    cfg, summary, _ = stream_run
    rows = _metrics(summary.run_dir)
    assert [r["step"] for r in rows] == list(range(1, STREAM_STEPS + 1))   # each step once
    assert check_ledger(summary.run_dir, _data_order(cfg, range(1, STREAM_STEPS + 1))) == []   # none lost, none repeated
    for step, row in enumerate(rows, start=1):
        assert all(math.isfinite(v) for v in row.values())
        assert row["rollout/samples"] == cfg.data.prompts_per_step * cfg.rollout.n   # whole groups
        # step s's prompts went in at the start of step max(1, s - 2), with weights max(0, s - 3);
        # step s updates version s - 1: lag at most min(s - 1, k) for every token and group
        bound = min(step - 1, 2)
        assert row["rollout/staleness_max"] <= bound
        assert sum(v for k, v in row.items() if k.startswith("stream/token_staleness_") and k[-1].isdigit()
                   and int(k.rsplit("_", 1)[1]) <= bound) == pytest.approx(1.0)
        assert 0.0 <= row["stream/rollout_busy_frac"] <= 1.0 and 0.0 <= row["stream/trainer_idle_frac"] <= 1.0
        # the next k steps' groups (none beyond the last step)
        assert row["stream/queued_groups"] == cfg.data.prompts_per_step * min(2, STREAM_STEPS - step)
    assert rows[4]["rollout/staleness_max"] == 2   # the bound is reached: the rollouts ran k steps ahead
    assert any(r["rollout/is_weight_mean"] != 1.0 for r in rows[1:])   # stale tokens were importance-weighted


def test_a_resumed_streaming_run_generates_the_groups_in_flight_again_and_loses_none(stream_run, assets, tmp_path):
    """From step 2's checkpoint the groups of steps 3 and 4, generating when it was written, are
    generated again; the ledger shows each prompt trained once, in the data order."""
    from raygraph.run.trainer import run

    cfg, summary, _ = stream_run
    resumed = run(load_config(TOY, _overrides(assets, tmp_path, **{
        **STREAM, "trainer.resume": summary.run_dir / "checkpoints" / "step_2"})))
    assert [r["step"] for r in _metrics(resumed.run_dir)] == [3, 4]
    assert check_ledger(resumed.run_dir, _data_order(cfg, [3, 4])) == []
    # generated again with the weights of the resume (version 2): step 3 lags 0, step 4 at most 1
    lags = [r["rollout/staleness_max"] for r in _metrics(resumed.run_dir)]
    assert lags[0] == 0.0 and lags[1] <= 1.0


def test_a_streaming_run_on_the_vllm_engine_with_lora_adapter_syncs_trains_the_data_order_within_k_versions(
        assets, tmp_path, ray_local, capsys):
    """The vLLM CPU engine streams too, here serving the policy's LoRA adapter: each sync loads a new
    adapter while later steps' samples are generating. Its waves run in the rollout actor's loop
    thread beside the actor's own calls (weight syncs, validation), under one lock."""
    pytest.importorskip("vllm")
    from raygraph.run.trainer import run

    cfg = load_config(TOY, _overrides(assets, tmp_path, **{**STREAM, "rollout.engine": "vllm",
                                                           "placement.rollout_workers": 1, "trainer.total_steps": 3,
                                                           "rollout.max_new_tokens": 24, "model.lora.rank": 4,
                                                           "model.lora.alpha": 8}))
    summary = run(cfg)
    assert "[raygraph] vLLM LoRA: adapter sync (" in capsys.readouterr().out
    rows = _metrics(summary.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert check_ledger(summary.run_dir, _data_order(cfg, range(1, 4))) == []
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 2.0]   # the k=2 lead, built up
    assert all(r["weights/bytes"] == r["weights/lora_sync_bytes"] < r["weights/full_bytes"] / 4 for r in rows)
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4   # fresh rows: vLLM's log-probs are the policy's
    assert rows[-1]["actor/entropy"] != rows[0]["actor/entropy"]   # the adapter moved the policy


def test_a_rollout_rank_killed_with_requests_in_flight_loses_nothing(stream_run):
    """kill -9 of a rollout rank while later steps' groups are generating on it: the run resumes
    from its newest checkpoint (streaming recovers at run level), those groups are generated again,
    and the ledger shows every prompt of the data order trained exactly once (the test above)."""
    cfg, summary, killer = stream_run
    assert killer.killed_at is not None and summary.steps_done == STREAM_STEPS
    rows = _metrics(summary.run_dir)
    # the ranks never caught up: when step 1 took its groups (before the kill), the samples of the
    # next k steps were generating (measured: all 32 of them)
    assert rows[0]["stream/in_flight"] > 0
    failure, resumed = [json.loads(x) for x in (summary.run_dir / "recoveries.jsonl").read_text().splitlines()]
    assert failure["kind"] == "run" and killer.victim in failure["dead_actors"]
    assert resumed["resumed_from"] in (1, 2)   # killed once step 2 trained: maybe before its checkpoint


@pytest.mark.slow
def test_the_demo_learns_with_streaming_rollouts_two_versions_stale(tmp_path, ray_local):
    """The demo (warm start, then GRPO on held-out addition mod 10) with streaming k=2 learns: the
    held-out accuracy rises from near chance, with tokens up to 2 versions stale importance-weighted
    (docs/streaming.md, "Learning": seed 0 measured 0.05 -> 0.30 / 0.46 / 0.47 at steps 80 / 100 / 120,
    twice 0.47 at step 120 with two runs at once on 2 cores; 0.47 / 0.32 / 0.60 at step 200 for seeds 0 / 1 / 2)."""
    from raygraph.run.trainer import run

    steps = 120
    cfg = load_config(REPO / "configs" / "demo.yaml", [
        f"trainer.output_dir={tmp_path}", "placement.mode=disaggregated", "placement.cpus_per_worker=0.5",
        "actor.old_logprobs=auto", "rollout.streaming=true", "placement.max_staleness=2", "logging.mlflow=false",
        f"trainer.total_steps={steps}", f"trainer.val_every={steps}", "trainer.save_every=0", "checkpoint.save_hf=false"])
    summary = run(cfg)
    rows = _metrics(summary.run_dir)
    assert summary.val_accuracy_start <= 0.15   # the warm start teaches the format only
    assert summary.val_accuracy_end >= max(0.25, summary.val_accuracy_start + 0.15)
    assert max(r["rollout/staleness_max"] for r in rows) == 2
    assert any(r["rollout/is_weight_mean"] != 1.0 for r in rows)
    assert check_ledger(summary.run_dir, _data_order(cfg, range(1, steps + 1))) == []


@pytest.mark.slow
def test_the_multiturn_demo_learns_with_streamed_episodes_two_versions_stale(tmp_path, ray_local):
    """The multi-turn demo (configs/demo_multiturn.yaml: a retry after a wrong first answer, with
    the answer as feedback) with streaming k=2 over two rollout ranks: episodes of the next two
    steps run while the policy trains, and a rollout rank is killed (kill -9) once step 12 has
    trained, with those episodes in flight. The run resumes from its newest checkpoint, each
    prompt is trained once in the data order, no token is more than k versions stale, and
    held-out success still rises by far more than 20 points in 25 steps, as in the synchronous demo
    (docs/streaming.md, "Multi-turn episodes": measured 0.14 -> 1.00)."""
    from killer import Killer

    from raygraph.run.trainer import run

    steps = 25
    cfg = load_config(REPO / "configs" / "demo_multiturn.yaml", [
        f"trainer.output_dir={tmp_path}", "placement.mode=disaggregated", "placement.rollout_workers=2",
        "placement.cpus_per_worker=0.5", "actor.old_logprobs=auto", "rollout.streaming=true",
        "placement.max_staleness=2", "logging.mlflow=false", f"trainer.total_steps={steps}",
        f"trainer.val_every={steps}", "trainer.save_every=5", "checkpoint.keep_last=0", "checkpoint.save_hf=false",
        "data.val_prompts=100", "run_name=mt", "trainer.max_restarts=1", "trainer.resume=auto"])
    killer = Killer(tmp_path / cfg.experiment / "mt", f"{cfg.experiment}/mt/", "rollout", after_step=12)
    summary = run(cfg)
    rows = _metrics(summary.run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert check_ledger(summary.run_dir, _data_order(cfg, range(1, steps + 1))) == []   # none lost, none repeated
    failure, resumed = [json.loads(x) for x in (summary.run_dir / "recoveries.jsonl").read_text().splitlines()]
    assert failure["kind"] == "run" and killer.victim in failure["dead_actors"] and resumed["resumed_from"] == 10
    for step, row in enumerate(rows, start=1):
        assert row["rollout/samples"] == cfg.data.prompts_per_step * cfg.rollout.n   # whole groups
        # after the resume from step 10 the lead of k steps is built up again
        assert row["rollout/staleness_max"] <= min(step - 1 if step <= 12 else step - 11, 2)
        assert 1.0 <= row["agent/turns_mean"] <= 2.0
    assert rows[4]["rollout/staleness_max"] == 2 and rows[0]["stream/in_flight"] > 0   # episodes ran ahead
    assert any(r["rollout/is_weight_mean"] != 1.0 for r in rows)   # stale tokens were importance-weighted
    # the validation before step 1 is the first attempt's: a recovered run reports the whole run
    assert summary.val_accuracy_start <= 0.3 and summary.val_accuracy_end >= summary.val_accuracy_start + 0.2
