"""`model.lora` in the config: bad settings fail before anything starts (`raygraph validate` exits
2 with the reason), and a LoRA run starts no reference role: its reference log-probs come from
`policy.ref_logprobs`, and the policy and HF rollout get the same adapters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raygraph.config import ConfigError, build_config, load_config
from raygraph.config.workflow_ref import load_workflow
from raygraph.graph.nodes import CallNode
from raygraph.models.lora import LoraSpec
from raygraph.run.graphs import build_graphs, worker_classes
from raygraph.run.role_specs import role_specs
from raygraph.workers.rollout_hf import HFRolloutWorker
from raygraph.workers.rollout_vllm import VLLMRolloutWorker

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": {"tiny": "tiny", "lora": {"rank": 4}},   # not built: /nonexistent/models/tiny-tiny
        "data": {"train_files": "t.parquet"}, "trainer": {"total_steps": 1, "output_dir": "/nonexistent"}}


def problems(*overrides: str, data: dict = TINY) -> list[str]:
    try:
        build_config(data, list(overrides))
    except ConfigError as exc:
        return exc.problems
    return []


def test_a_valid_lora_config_has_no_problems():
    assert problems() == []
    assert problems("model.lora.target_modules=[q_proj,v_proj]", "model.lora.rank=32") == []


@pytest.mark.parametrize(("overrides", "message"), [
    (("model.lora.target_modules=[qproj]",), "model.lora.target_modules: 'qproj' matches no module of the model"),
    (("model.lora.target_modules=[model.norm]",), "'model.norm' matches Qwen2RMSNorm modules, not linear layers"),
    # the tiny preset's k_proj maps 64 -> 32
    (("model.lora.rank=33",), "model.lora.rank=33 is larger than the smaller dimension (32) of "
                              "model.layers.0.self_attn.k_proj"),
    (("model.lora.dropout=0.1", "actor.ppo_epochs=2"), "model.lora.dropout=0.1 with old log-probs from a "
                                                       "recompute pass"),
    (("model.dtype=bfloat16", "placement.train_workers=2"), "model.lora with placement.train_workers=2 (FSDP2) "
                                                             "needs model.dtype=float32"),
    (("model.lora.rank=0",), "model.lora.rank=0: input should be greater than or equal to 1"),
])
def test_bad_lora_settings_are_config_problems(overrides, message):
    found = problems(*overrides)
    assert any(message in p for p in found), found


def test_lora_dropout_is_fine_where_no_second_pass_compares_it():
    assert problems("model.lora.dropout=0.1") == []                                  # one on-policy step
    assert problems("model.lora.dropout=0.1", "workflow=sft", "data.format=sft") == []


@pytest.mark.slow   # a subprocess (or two torch ranks): not in `make test-fast`
def test_validate_exits_2_without_a_traceback(tmp_path, tiny_model_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "demo_lora.yaml").read_text().replace("rank: 8", "rank: 100"))
    result = subprocess.run([sys.executable, "-m", "raygraph.cli", "validate", str(bad),
                             f"model.path={tiny_model_path}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "model.lora.rank=100 is larger than the smaller dimension (32)" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_reference_role_and_the_graph_asks_the_policy():
    cfg = build_config(TINY, ["actor.kl_loss_coef=0.01", "rollout.engine=hf"])
    assert cfg.uses_reference and cfg.reference_from_policy
    assert "reference" not in worker_classes(cfg, ("policy", "rollout", "reward"))
    specs = role_specs(cfg, ("policy", "rollout", "reward"))
    assert set(specs) == {"policy", "rollout", "reward"}
    spec = LoraSpec(rank=4, alpha=16.0, dropout=0.0, target_modules="all-linear")
    assert specs["policy"].kwargs["lora"] == spec and specs["policy"].kwargs["lora_sync"] == "adapter"
    assert specs["rollout"].kwargs["lora"] == spec
    step, _ = build_graphs(cfg, load_workflow(cfg.workflow))
    assert "policy.ref_logprobs" in repr_methods(step)


def test_dpo_with_lora_uses_the_policy_as_reference():
    cfg = build_config(TINY, ["workflow=dpo", "data.format=dpo", "rollout.engine=hf"])
    assert "reference" not in worker_classes(cfg, ("policy", "reference", "rollout", "reward"))
    step, _ = build_graphs(cfg, load_workflow(cfg.workflow))
    assert "policy.ref_logprobs" in repr_methods(step)


BINDS_THE_REFERENCE = """
from raygraph.graph import InputNode, MultiOutputNode

ROLES = ("policy", "rollout", "reward", "reference")


def build(roles, cfg):
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        return MultiOutputNode([roles.gather(rollouts, roles.reference.bind("logprobs", rollouts))])
"""


def test_a_workflow_binding_the_reference_role_under_lora_fails_validate_naming_the_fix(tmp_path, capsys):
    """docs/lora.md: no reference role runs with LoRA; a workflow that binds `roles.reference`
    fails at `raygraph validate` and is told to bind `reference_logprobs` instead."""
    from raygraph.cli import EXIT_BAD_CONFIG, EXIT_OK, main

    workflow, toy = tmp_path / "wf.py", str(ROOT / "configs" / "grpo_toy.yaml")
    workflow.write_text(BINDS_THE_REFERENCE)
    assert main(["validate", toy, f"workflow={workflow}", "actor.kl_loss_coef=0.01"]) == EXIT_OK   # no LoRA: it runs
    capsys.readouterr()
    assert main(["validate", toy, f"workflow={workflow}", "actor.kl_loss_coef=0.01", "model.lora.rank=4"]) \
        == EXIT_BAD_CONFIG
    assert capsys.readouterr().err == (
        f"1 config problem in {toy}:\n  - workflow this run has no role 'reference': with model.lora the frozen "
        "base model is the reference and no reference role is started; bind "
        "raygraph.graph.fragments.reference_logprobs(roles, cfg, batch) (policy.ref_logprobs with the adapter "
        "disabled) instead of reference.logprobs\n")


def test_the_policy_and_the_vllm_engine_get_the_same_sync_mode():
    spec = LoraSpec(rank=4, alpha=16.0)
    assert HFRolloutWorker.lora_sync_for("/nonexistent/tiny", spec)[0] == "adapter"
    # no model config to inspect (not built yet): vLLM cannot be shown to serve it, merged weights
    mode, line = VLLMRolloutWorker.lora_sync_for("/nonexistent/tiny", spec)
    assert mode == "merged" and line.startswith("vLLM LoRA: merged weights because the model config")
    cfg = build_config(TINY, ["rollout.engine=vllm"])
    specs = role_specs(cfg, ("policy", "rollout", "reward"))
    assert specs["policy"].kwargs["lora_sync"] == specs["rollout"].kwargs["lora_sync"] == "merged"
    assert specs["rollout"].kwargs["lora"] == specs["policy"].kwargs["lora"]


def test_vllm_serves_the_adapter_when_it_can(tiny_model_path):
    pytest.importorskip("vllm")
    from raygraph.workers import vllm_compat

    mode, line = VLLMRolloutWorker.lora_sync_for(tiny_model_path, LoraSpec(rank=4))   # Qwen2, rank 4
    assert mode == "adapter" and line == "vLLM LoRA: adapter sync (32768 bytes per sync)"
    assert "largest max_lora_rank" in vllm_compat.lora_support(tiny_model_path, 1024, "all-linear")
    assert "lm_head" in vllm_compat.lora_support(tiny_model_path, 4, ("q_proj", "lm_head"))


def test_the_shipped_lora_config_loads():
    cfg = load_config(ROOT / "configs" / "demo_lora.yaml")
    assert cfg.model.lora.rank == 8 and cfg.reference_from_policy and cfg.uses_reference


def repr_methods(node) -> set[str]:
    """`role.method` of every bound call in a graph."""
    seen, todo, found = set(), [node], set()
    while todo:
        n = todo.pop()
        if id(n) not in seen:
            seen.add(id(n))
            if isinstance(n, CallNode):
                found.add(f"{n.role}.{n.method}")
            todo.extend(n._deps())
    return found
