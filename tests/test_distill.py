"""Extra models: `reference.model_path`, a workflow's own frozen roles (`extra_roles`), placed and
optionally FSDP-sharded like any role, and the on-policy distillation workflow built on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from raygraph.algos.distill import reverse_kl, reverse_kl_advantages
from raygraph.config import ConfigError, load_config
from raygraph.models.tiny import build_tiny_lm

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "configs" / "grpo_toy.yaml"


def test_reverse_kl_advantages_by_hand():
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.3, 0.0]])
    teacher = torch.tensor([[-1.5, -0.5, -2.0], [-0.2, -3.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # -(lp - q): [-(1.0), -(-0.5), -(0)] = [-1, 0.5, 0]; [-(0.1), -(2.7), masked] = [-0.1, -2.7, 0]
    expected = torch.tensor([[-1.0, 0.5, 0.0], [-0.1, -2.7, 0.0]])
    torch.testing.assert_close(reverse_kl_advantages(logprobs, teacher, mask, coef=1.0), expected)
    torch.testing.assert_close(reverse_kl_advantages(logprobs, teacher, mask, coef=0.5), expected / 2)
    # mean over the 5 real tokens of lp - q: (1.0 - 0.5 + 0 + 0.1 + 2.7) / 5 = 0.66
    assert reverse_kl(logprobs, teacher, mask) == pytest.approx(0.66)


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory, tiny_model_path) -> str:
    """The student's own tiny model made sharp (same tokenizer): its final norm scaled x3 scales its
    logits x3, so the teacher puts most mass on the student's likeliest tokens and the student must
    learn to concentrate where the teacher does (reverse KL ~1.5 nats per token at the start)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("teacher")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return str(path)


def _distill_overrides(tiny_model_path, teacher_path, **more) -> list[str]:
    overrides = {"workflow": "distill", "model.path": tiny_model_path, "model.tiny": "null", "algorithm.advantage": "null",
                 "extra_roles": json.dumps({"teacher": {"model_path": teacher_path}}), **more}
    return [f"{k}={v}" for k, v in overrides.items()]


def test_a_role_of_the_workflow_needs_a_model_and_a_known_name(tiny_model_path, teacher_path, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(TOY, ["workflow=distill"])
    assert "extra_roles.teacher.model_path" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(TOY, _distill_overrides(tiny_model_path, teacher_path)
                    + ['extra_roles.teachr={"model_path": "' + teacher_path + '"}'])
    assert "extra_roles.teachr: workflow 'distill' binds no role 'teachr' (did you mean 'teacher'?)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(TOY, ["workflow=distill", 'extra_roles={"teacher": {"model_path": "./no/such/model"}}'])
    assert "extra_roles.teacher.model_path='./no/such/model': no such model directory" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(TOY, ['extra_roles={"policy": {"model_path": "' + teacher_path + '"}}'])
    assert "extra_roles.policy: a built-in role" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(TOY, [f"reference.model_path={teacher_path}"])
    assert "reference.model_path is set but no reference runs" in str(err.value)


def test_a_teacher_with_another_vocabulary_is_refused(tiny_model_path, tmp_path):
    other = tmp_path / "other_vocab"
    build_tiny_lm(other, seed=2)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 7
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_config(TOY, _distill_overrides(tiny_model_path, str(other)))
    assert f"has a vocabulary of {config['vocab_size']} tokens but the policy" in str(err.value)


def test_the_teacher_is_placed_like_the_reference_or_on_its_own_pool(tiny_model_path, teacher_path):
    from raygraph.run.role_specs import placement_plan, role_specs

    cfg = load_config(TOY, _distill_overrides(tiny_model_path, teacher_path))
    specs = role_specs(cfg, ("policy", "rollout", "reward", "teacher"))
    teacher = specs["teacher"]
    assert teacher.kwargs["model_path"] == teacher_path and teacher.kwargs["column"] == "teacher_logprobs"
    fused = placement_plan(cfg, ("policy", "rollout", "reward", "teacher")).fused
    assert fused == (("policy", "rollout", "reward", "teacher"),)   # one process per rank
    pools = json.dumps({"train": {"bundles": 2}, "rollout": {"bundles": 1}, "big": {"bundles": 2}})
    roles = json.dumps({"policy": "train", "rollout": "rollout", "reward": "rollout", "teacher": "big"})
    cfg = load_config(TOY, _distill_overrides(
        tiny_model_path, teacher_path, **{"placement.mode": "disaggregated", "placement.pools": pools,
                                          "placement.roles": roles, "placement.train_workers": 2, "data.prompts_per_step": 4}))
    specs = role_specs(cfg, ("policy", "rollout", "reward", "teacher"))
    assert (specs["teacher"].pool, specs["teacher"].world_size) == ("big", 2)
    fused = placement_plan(cfg, ("policy", "rollout", "reward", "teacher")).fused
    assert fused == (("rollout", "reward"),)   # the teacher has its own actors


def test_reference_model_path_is_the_reference_even_with_lora(tiny_model_path, teacher_path):
    from raygraph.run.role_specs import role_specs

    lora = 'model.lora={"rank": 2, "target_modules": "all-linear"}'
    cfg = load_config(TOY, [f"model.path={tiny_model_path}", "model.tiny=null", "actor.kl_loss_coef=0.1",
                            f"reference.model_path={teacher_path}", lora])
    assert not cfg.reference_from_policy   # another model: a reference role runs
    assert role_specs(cfg, ("policy", "rollout", "reward"))["reference"].kwargs["model_path"] == teacher_path


@pytest.mark.parametrize("world", [1, 2])
def test_teacher_logprobs_equal_the_teacher_model_computed_without_ray(world, tiny_model_path, teacher_path,
                                                                       ray_local, rollout_batch):
    """The teacher role (2 ranks: FSDP-sharded, each rank a shard of the batch) returns exactly
    the log-probs of the teacher model computed here, in this process, without Ray."""
    from raygraph.batch import Batch
    from raygraph.cluster import build_roles
    from raygraph.models.loading import load_causal_lm
    from raygraph.models.logprobs import response_logprobs
    from raygraph.run.role_specs import pools_for, role_specs

    cfg = load_config(TOY, _distill_overrides(
        tiny_model_path, teacher_path, **{"placement.train_workers": world, "placement.rollout_workers": world,
                                          "extra_roles.teacher.shard": "true"}))
    specs = {"teacher": role_specs(cfg, ("teacher",))["teacher"]}
    batch = rollout_batch(9, seed=3)   # 9 rows: the 2 ranks score shards of 4 and 5
    expected, _ = response_logprobs(load_causal_lm(teacher_path).eval(), batch)
    with build_roles(f"test-teacher-{world}", pools_for(cfg), specs, colocate=[]) as roles:
        shards = roles.teacher.call_sharded("logprobs", batch)
    assert [len(s) for s in shards] == ([9] if world == 1 else [4, 5])
    got = Batch.concat(shards)["teacher_logprobs"]
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    assert got.abs().sum() > 0


def test_on_policy_distillation_lowers_the_reverse_kl_to_the_teacher(tmp_path, monkeypatch, tiny_model_path,
                                                                     teacher_path, ray_local):
    """The student samples, the sharp teacher scores; 20 steps of per-token reverse-KL advantages
    cut the measured reverse KL to the teacher (a one-sample estimate on the student's own tokens)."""
    from raygraph.run.trainer import run

    monkeypatch.chdir(tmp_path)
    overrides = _distill_overrides(tiny_model_path, teacher_path, **{
        "data.train_files": "[data/train.parquet]", "data.val_files": "[data/val.parquet]", "data.val_prompts": 4,
        "data.prompts_per_step": 8, "rollout.n": 4, "actor.optim.lr": 2e-3, "trainer.total_steps": 20,
        "trainer.output_dir": "runs", "logging.mlflow": "false", "checkpoint.save_hf": "false",
        "trainer.save_every": 0, "workflow_args.coef": 1.0})
    summary = run(load_config(TOY, overrides))
    rows = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [r["distill/reverse_kl"] for r in rows]
    assert len(kl) == 20 and all(k > 0 for k in kl[:2])
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5   # means of 5 steps: the estimate is one sample a token
    print(f"reverse KL: first 5 steps {first:.3f}, last 5 steps {last:.3f}", [round(k, 3) for k in kl])
    assert last < 0.75 * first, kl
    assert yaml.safe_load((summary.run_dir / "config.yaml").read_text())["extra_roles"]["teacher"]["model_path"] \
        == teacher_path


def test_the_doc_teacher_term_by_hand(tmp_path):
    """docs/custom-algorithm.md's `add_teacher_term`: advantages + beta (log q - log pi)."""
    from test_custom_code import write_doc_file

    from raygraph.algos.user_code import load_function
    from raygraph.batch import ADVANTAGES, RESPONSE_MASK, ROLLOUT_LOGPROBS, Batch

    add = load_function(f"{write_doc_file(tmp_path, 'grpo_with_teacher.py')}:add_teacher_term")
    batch = Batch({ADVANTAGES: torch.tensor([[1.0, 1.0], [-1.0, 0.0]]), RESPONSE_MASK: torch.tensor([[1, 1], [1, 0]]),
                   ROLLOUT_LOGPROBS: torch.tensor([[-1.0, -2.0], [-0.5, 0.0]]),
                   "teacher_logprobs": torch.tensor([[-0.5, -3.0], [-0.5, -7.0]])})
    # beta 0.5: 1 + 0.5 (-0.5 + 1) = 1.25; 1 + 0.5 (-3 + 2) = 0.5; -1 + 0; 0 (padding)
    torch.testing.assert_close(add(batch, beta=0.5)[ADVANTAGES], torch.tensor([[1.25, 0.5], [-1.0, 0.0]]))


def test_the_doc_teacher_workflow_runs_from_a_user_file_on_two_ranks(tmp_path, monkeypatch, tiny_model_path,
                                                                     teacher_path, ray_local):
    """The doc's workflow and config, as user files outside the repository: 2 policy ranks (FSDP)
    and a teacher FSDP-sharded over its own 2 ranks, fused with the policy's processes."""
    from test_custom_code import write_doc_file

    from raygraph.run.trainer import run

    write_doc_file(tmp_path, "grpo_with_teacher.py")
    doc = yaml.safe_load(write_doc_file(tmp_path, "teacher.yaml").read_text())
    doc["extra_roles"]["teacher"]["model_path"] = teacher_path
    monkeypatch.chdir(tmp_path)
    overrides = {"workflow": doc["workflow"], "workflow_args": json.dumps(doc["workflow_args"]),
                 "extra_roles": json.dumps(doc["extra_roles"]), "model.path": tiny_model_path,
                 "model.tiny": "null", "placement.train_workers": 2, "placement.rollout_workers": 2,
                 "data.train_files": "[data/train.parquet]", "data.val_files": "[data/val.parquet]",
                 "data.val_prompts": 4, "trainer.total_steps": 2, "trainer.output_dir": "runs",
                 "logging.mlflow": "false", "checkpoint.save_hf": "false"}
    summary = run(load_config(TOY, [f"{k}={v}" for k, v in overrides.items()]))
    rows = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)
    saved = yaml.safe_load((summary.run_dir / "config.yaml").read_text())
    assert saved["workflow_args"] == {"beta": 0.1} and saved["extra_roles"]["teacher"]["shard"] is True
