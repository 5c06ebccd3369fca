"""Multi-turn episodes in every workflow and placement: `configs/demo_multiturn.yaml` (the tiny
model, `retry_with_feedback`, `reward.kind: env`) trained through `raygraph train` for two steps
with PPO (critic, GAE, KL in the reward), RLOO (with a KL loss), REINFORCE++, ReMax, GRPO with
DAPO's dynamic sampling, GRPO with LoRA, and GRPO asynchronously (disaggregated, one step stale)
with an exact resume from a checkpoint holding prefetched episodes; and the demo's task as an
agent program (`rollout.agent.program`) under PPO, disaggregated, with LoRA.

What every run must show (`_steps`): exit code 0, one metrics line per step with the agent
metrics, every number finite, and the policy's log-probs of the multi-turn rows (observations
attended, not scored) equal to the engine's at the weights that sampled them. Each test adds the
numbers its variant changes, derived by hand from the step's rollout dump where the estimator
allows it (RLOO, REINFORCE++, ReMax, GRPO).

All runs share one working folder and output folder (the toy data and the tiny model are built
once) and one Ray instance: about 2 minutes in all on 2 busy CPU cores (10-20 s per run).

Not here: vLLM colocated (it works; one step took 115 s on 2 CPU cores, mostly engine start-up,
and tests/agents/test_agent_rollout.py already runs multi-turn episodes on vLLM, disaggregated).
DAPO's length options on episodes (the last test): the overlong penalty measures an episode's model
tokens against `max_turns` x the tokens of a turn, and the truncation mask reads why it ended.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from raygraph.cli import main

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo_multiturn.yaml")
N, PROMPTS = 8, 32   # the demo's rollout.n and data.prompts_per_step
ROWS = N * PROMPTS
SHORT = ("trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0", "logging.mlflow=false",
         "data.val_prompts=8", "trainer.dump_rollouts=1")
NO_WARM_START = "trainer.warm_start=null"
NOT_COMPARABLE = ("timing/", "perf/", "weights/sync_s", "weights/gbytes_per_s")   # wall-clock figures


@pytest.fixture(scope="module")
def train(tmp_path_factory, ray_local):
    """`train(name, *overrides) -> run dir`: the demo for 2 steps through the CLI, run from a
    folder of its own (the demo's data paths are relative), output under one shared folder."""
    root = tmp_path_factory.mktemp("agent_workflows")
    cwd, out = root / "cwd", root / "out"
    cwd.mkdir()

    def run(name: str, *overrides: str) -> Path:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(cwd)
            code = main(["train", DEMO, f"trainer.output_dir={out}", f"run_name={name}", *SHORT, *overrides])
        assert code == 0, f"raygraph train ({name}) exited {code}; its log is in the captured output"
        return out / "demo_multiturn" / name

    return run


def _steps(run: Path, steps: int = 2) -> list[dict]:
    """The run's metrics lines, after the checks every multi-turn run must pass."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert [k for k, v in r.items() if not math.isfinite(v)] == [] and r["health/non_finite_metrics"] == 0
        assert 1.0 <= r["agent/turns_mean"] <= r["agent/turns_max"] <= 2.0   # demo: max_turns 2
        assert r["agent/truncated/turns"] == 0.0   # a second turn only after a wrong first answer
        assert r["actor/skipped_steps"] == 0.0 and r["actor/empty_updates"] == 0.0
        assert r["weights/verified"] == 1.0
    return rows


def _dump(run: Path, step: int) -> list[dict]:
    """The step's training rollouts (`trainer.dump_rollouts=1`): score, advantage, conversation."""
    path = run / "samples" / f"train_step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _groups(records: list[dict]) -> dict[str, list[dict]]:
    groups = defaultdict(list)
    for r in records:
        groups[r["uid"]].append(r)
    return groups


def _check_episode_scores(records: list[dict]) -> None:
    """A row's score is its episode's return: the sum of the rewards of its turns."""
    for r in records:
        assert r["score"] == pytest.approx(sum(m.get("reward", 0.0) for m in r["conversation"]))
        assert 1 <= sum(m["role"] == "assistant" for m in r["conversation"]) <= 2


def _check_reference_attends_the_observations(first: dict) -> None:
    """At step 1 the reference is the policy that sampled: the mean k1 KL of the rollout's
    log-probs to the reference's (`actor/kl_in_reward`, computed before the update) is ~0. A
    reference blind to the observation tokens gives about -8e-4 on the tiny model's episodes (measured)."""
    assert abs(first["actor/kl_in_reward"]) < 1e-6


# ------------------------------------------------------------------------------ one run each
@pytest.mark.slow
def test_ppo_fits_a_critic_and_whitens_gae_over_the_model_tokens_only(train):
    # PPO as configs/toy/ppo.yaml runs it: GAE, a critic, the KL penalty in the token reward
    rows = _steps(train("ppo", "workflow=ppo", "algorithm.advantage=gae", "algorithm.kl_in_reward.coef=0.01",
                        NO_WARM_START))
    for r in rows:
        assert r["rollout/samples"] == ROWS and r["rollout/logprob_diff_max"] < 1e-5
        assert r["critic/optimizer_steps"] >= 1 and r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0
        # Whitening over the response_mask tokens: mean 0 there (observation tokens left out).
        # The critic's values make the advantages non-zero even while every return is 0.
        assert abs(r["actor/advantage_mean"]) < 1e-5 and r["actor/advantage_abs_max"] > 0.1
        assert "timing/reference.logprobs_s" in r and r["actor/kl_coef"] == 0.01
    _check_reference_attends_the_observations(rows[0])


@pytest.mark.slow
def test_rloo_advantages_are_leave_one_out_episode_returns(train):
    # RLOO runs GRPO's graph; with a KL loss to the reference (which leaves the advantages alone)
    run = train("rloo", "workflow=rloo", "algorithm.advantage=rloo", "actor.kl_loss_coef=0.01", NO_WARM_START)
    rows = _steps(run)
    for r in rows:
        assert r["rollout/samples"] == ROWS and r["rollout/logprob_diff_max"] < 1e-5
        assert "timing/reference.logprobs_s" in r and r["actor/kl_loss"] > 0
    _check_reference_attends_the_observations(rows[0])
    for step in (1, 2):
        records = _dump(run, step)
        _check_episode_scores(records)
        for group in _groups(records).values():   # A_i = n/(n-1) (s_i - mean(s))
            mean = sum(r["score"] for r in group) / N
            for r in group:
                assert r["advantage"] == pytest.approx(N / (N - 1) * (r["score"] - mean), abs=1e-6)
    assert any(r["score"] for r in _dump(run, 2)), "seed 0 has one success at step 2; else this checks zeros only"


@pytest.mark.slow
def test_reinforce_pp_whitens_the_return_to_go_over_the_model_tokens(train):
    run = train("rpp", "workflow=reinforce_pp", "algorithm.advantage=reinforce_pp", NO_WARM_START)
    for r in _steps(run):
        assert r["rollout/samples"] == ROWS and r["rollout/logprob_diff_max"] < 1e-5
        assert abs(r["actor/advantage_mean"]) < 1e-5
    for step in (1, 2):
        records = _dump(run, step)
        _check_episode_scores(records)
        # gamma = 1 and the rewards sit on model tokens, so every model token of an episode has
        # the return-to-go G = its score (carried over the observation tokens); whitening over the
        # batch's model tokens (response_length each, observations left out) then gives each row
        # A = (s - mu) / sqrt(var + 1e-8), mu and the unbiased var over tokens.
        scores = torch.tensor([r["score"] for r in records], dtype=torch.float64)
        lengths = torch.tensor([r["response_length"] for r in records], dtype=torch.float64)
        mu = (lengths * scores).sum() / lengths.sum()
        var = (lengths * (scores - mu) ** 2).sum() / (lengths.sum() - 1)
        expected = (scores - mu) / (var + 1e-8).sqrt()
        assert [r["advantage"] for r in records] == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-5)
    assert any(r["score"] for r in _dump(run, 2)), "seed 0 has one success at step 2; else this checks zeros only"


@pytest.mark.slow
def test_remax_subtracts_the_greedy_episode_return(train):
    run = train("remax", "workflow=remax", "algorithm.advantage=remax", NO_WARM_START)
    for r in _steps(run):
        assert r["rollout/samples"] == ROWS and r["rollout/logprob_diff_max"] < 1e-5
    for step in (1, 2):
        records = _dump(run, step)
        _check_episode_scores(records)
        # A_t = G_t - b with G_t = the episode's return on every model token (gamma = 1) and b the
        # return of the prompt's greedy episode: one baseline per group, itself a possible return
        for group in _groups(records).values():
            baselines = {round(r["score"] - r["advantage"], 5) for r in group}
            assert len(baselines) == 1 and baselines <= {0.0, 0.5, 1.0}
    assert any(r["score"] for r in _dump(run, 2)), "seed 0 has one success at step 2; else this checks zeros only"


@pytest.mark.slow
def test_dynamic_sampling_keeps_the_episode_groups_whose_success_varies(train):
    # A short warm start (20 SFT steps): without it the random model almost never succeeds, and
    # every group of a step may be filtered out.
    run = train("dapo", "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.metric=acc",
                "algorithm.dynamic_sampling.max_extra_rounds=2", "trainer.warm_start.steps=20")
    for step, r in enumerate(_steps(run), start=1):
        kept = int(r["rollout/groups_kept"])
        assert kept >= 1 and r["rollout/samples"] == r["rollout/train_rows"] == N * kept
        assert r["rollout/groups_total"] == PROMPTS * r["rollout/gen_rounds"]
        assert r["rollout/logprob_diff_max"] < 1e-5
        records = _dump(run, step)
        _check_episode_scores(records)
        groups = _groups(records)
        assert len(groups) == kept
        for group in groups.values():   # acc: the episode's return > 0; it varies in each kept group
            assert all(r["acc"] == float(r["score"] > 0) for r in group)
            assert len({r["acc"] for r in group}) == 2


@pytest.mark.slow
def test_lora_scores_the_reference_with_the_adapter_off_and_syncs_the_adapter(train):
    # The entropy bonus moves the adapters at step 1 (every return is 0 there).
    run = train("lora", "model.lora.rank=8", "model.lora.alpha=16", "actor.kl_loss_coef=0.001",
                "actor.entropy_coef=0.01", NO_WARM_START)
    first, second = _steps(run)
    for r in (first, second):
        assert r["weights/bytes"] == r["weights/lora_sync_bytes"] < r["weights/full_bytes"]
        assert "timing/policy.ref_logprobs_s" in r and not any("reference" in k for k in r)
        assert r["rollout/logprob_diff_max"] < 1e-5
    _check_reference_attends_the_observations(first)   # the base: B = 0 at step 1
    assert second["actor/kl_loss"] > 0.0   # the adapters moved
    assert (run / "checkpoints" / "step_2" / "hf_adapter" / "adapter_config.json").is_file()
    for step in (1, 2):
        records = _dump(run, step)
        _check_episode_scores(records)
        for group in _groups(records).values():   # GRPO: (s_i - mean) / (unbiased std + 1e-6)
            scores = torch.tensor([r["score"] for r in group])
            expected = (scores - scores.mean()) / (scores.std() + 1e-6)
            assert [r["advantage"] for r in group] == pytest.approx(expected.tolist(), abs=1e-4)


# ---------------------------------------------------------- an agent program instead of the environment
PROGRAM = ("rollout.agent.env=null", "rollout.agent.program=raygraph.agents.demo_program:run")


PROGRAM_PPO = (*PROGRAM, "workflow=ppo", "algorithm.advantage=gae", "algorithm.kl_in_reward.coef=0.01",
               "placement.mode=disaggregated", "model.lora.rank=8", "model.lora.alpha=16",
               "trainer.save_every=1", "checkpoint.keep_last=0", NO_WARM_START)


@pytest.fixture(scope="module")
def program_run(train) -> Path:
    return train("program_ppo", *PROGRAM_PPO)


@pytest.mark.slow
def test_an_agent_program_trains_with_ppo_disaggregated_and_lora(program_run):
    """configs/demo_program.yaml's program (the demo's task through an OpenAI client) under PPO with
    a critic, the rollout on a rank of its own and LoRA adapters synced to it: the rows of every
    episode carry the program's reward, and the policy's log-probs are the engine's."""
    for r in _steps(program_run):
        assert r["rollout/logprob_diff_max"] < 1e-5 and r["critic/optimizer_steps"] >= 1
        assert r["weights/bytes"] == r["weights/lora_sync_bytes"] < r["weights/full_bytes"]
    for step in (1, 2):
        records, episodes = _dump(program_run, step), 0
        for r in records:
            if r["conversation"][-1]["role"] == "program":   # an episode's last row (the others: split off)
                episodes += 1
                assert r["score"] == r["conversation"][-1]["reward"]
        assert episodes == ROWS and len(records) >= ROWS


@pytest.mark.slow
def test_an_agent_program_run_resumes_exactly(train, program_run):
    """Every call is seeded from its episode and its number, and the HF engine's waves hold every
    running episode's next call (sorted by episode): a resume from step 1 redoes step 2 exactly.
    The resumed run sends its weights over gloo (`placement.weight_sync_shared_memory=false`, as
    between hosts), the first through shared memory: the step is the same either way."""
    resumed = train("program_resumed", *PROGRAM_PPO, f"trainer.resume={program_run / 'checkpoints' / 'step_1'}",
                    "placement.weight_sync_shared_memory=false")
    (got,) = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    expected = _steps(program_run)[1]
    assert got["step"] == 2 and set(got) == set(expected)
    assert expected["weights/via_shared_memory"] == 1.0 and got.pop("weights/via_shared_memory") == 0.0
    expected.pop("weights/via_shared_memory")
    assert {k: v for k, v in got.items() if not k.startswith(NOT_COMPARABLE)} == \
        {k: v for k, v in expected.items() if not k.startswith(NOT_COMPARABLE)}
    assert _dump(resumed, 2) == _dump(program_run, 2)


# ------------------------------------------------------------- asynchronous, and resumed from step 1
ASYNC = ("placement.mode=disaggregated", "placement.max_staleness=1",
         "actor.old_logprobs=auto",   # the demo's `rollout` is refused with stale rollouts
         "actor.entropy_coef=0.5", "actor.optim.lr=0.01",   # moves the policy while every return is 0
         "trainer.save_every=1", "checkpoint.keep_last=0", NO_WARM_START)


@pytest.fixture(scope="module")
def async_run(train) -> Path:
    return train("async", *ASYNC)


@pytest.mark.slow
def test_async_trains_on_episodes_prefetched_one_step_ahead(async_run):
    first, second = _steps(async_run)
    # step 1 samples now: the policy's recomputed log-probs of the episodes are the rollout's
    assert first["rollout/staleness"] == 0.0
    assert first["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["rollout/is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    # step 2 trains on the episodes sampled during step 1's update, with the older weights
    assert second["rollout/staleness"] == second["rollout/staleness_max"] == 1.0
    assert second["weights/rollout_version_min"] == second["weights/version"] - 2
    assert second["rollout/is_weight_mean"] != pytest.approx(1.0, abs=1e-4)
    assert second["rollout/samples"] == ROWS
    # the checkpoint of step 1 holds those episodes, conversations included, as JSON
    (kept,) = json.loads((async_run / "checkpoints" / "step_1" / "rollout" / "rank0" / "prefetched.json").read_text())
    assert {"agent_conversation", "agent_truncation"} <= set(kept["non_tensors"])
    assert {"response_attention", "env_scores", "agent_turns"} <= set(kept["tensors"])
    conversations = kept["non_tensors"]["agent_conversation"]
    assert len(conversations) == ROWS and all(c[0]["role"] == "assistant" for c in conversations)


@pytest.mark.slow
def test_async_resume_from_a_checkpoint_with_prefetched_episodes_is_exact(train, async_run):
    from safetensors.torch import load_file

    resumed = train("async_resumed", *ASYNC, f"trainer.resume={async_run / 'checkpoints' / 'step_1'}")
    (got,) = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    expected = _steps(async_run)[1]
    assert got["step"] == 2 and got["rollout/staleness"] == 1.0   # the stored episodes, not new ones
    assert set(got) == set(expected)
    for key, value in expected.items():
        if not key.startswith(NOT_COMPARABLE):
            assert got[key] == value, key
    final, reference = (load_file(run / "checkpoints" / "step_2" / "hf" / "model.safetensors")
                        for run in (resumed, async_run))
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[name], reference[name]) for name in reference)


# ------------------------------------------------------------------ DAPO's length options (a bug)
def test_dapo_length_options_measure_episodes_by_their_own_budget():
    from raygraph.batch import (
        AGENT_TRUNCATION,
        RESPONSE_ATTENTION,
        RESPONSE_LENGTH,
        RESPONSE_MASK,
        TOKEN_LEVEL_SCORES,
        Batch,
    )
    from raygraph.config import load_config
    from raygraph.graph import dapo
    from raygraph.graph.fragments import response_budget

    budget = response_budget(load_config(DEMO))
    assert budget == 2 * 3   # the demo: max_turns 2 x rollout.max_new_tokens 3
    # Two episodes: two turns of 2 model tokens each with an observation of 2 tokens between
    # (tokens: m m o o m m); the first finished, the second ran out of turns.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]] * 2)
    batch = Batch({RESPONSE_MASK: mask, RESPONSE_ATTENTION: torch.ones_like(mask),
                   TOKEN_LEVEL_SCORES: torch.zeros(2, 6), RESPONSE_LENGTH: mask.sum(-1)},
                  {AGENT_TRUNCATION: ["none", "turns"]})
    # 4 model tokens of 6: inside L_max - L_cache = 5, no penalty
    assert dapo.overlong_penalty(batch, max_len=budget, buffer=1, factor=1.0).meta["overlong_penalty"] == 0.0
    # 4 tokens with L_max 4, L_cache 2: penalty (2 - 4) / 2 = -1, on the last model token
    penalised = dapo.overlong_penalty(batch, max_len=4, buffer=2, factor=1.0)
    assert penalised[TOKEN_LEVEL_SCORES][:, 5].tolist() == [-1.0, -1.0]
    masked = dapo.mask_truncated(batch, max_len=budget)
    assert masked.meta["truncated_rows"] == 1 and masked[RESPONSE_MASK].tolist() == [[1, 1, 0, 0, 1, 1], [0] * 6]
