"""The role-kind table (`raygraph.config.role_kinds`) and what reads it: the worker and argument
tables keyed by its kinds, and the placement plan computed once from the config (no Ray started)."""

from __future__ import annotations

import pytest

from raygraph.config import load_config
from raygraph.config.role_kinds import DEFAULT_ROLES, EXTRA, ROLE_KINDS, ROLES, kind_of
from raygraph.run.graphs import WORKERS
from raygraph.run.role_specs import WORKER_ARGS, placement_plan, pools_for, role_specs
from raygraph.run.stage_recovery import stateless_roles

TOY = "configs/grpo_toy.yaml"
GRPO = ("policy", "rollout", "reward")


def _cfg(tmp_path, *overrides):
    return load_config(TOY, [f"trainer.output_dir={tmp_path}", *overrides])


def test_every_kind_has_exactly_one_worker_table_and_one_argument_builder():
    kinds = [kind.name for kind in ROLE_KINDS]
    assert len(set(kinds)) == len(kinds)
    assert list(WORKERS) == kinds and list(WORKER_ARGS) == kinds


def test_the_table_answers_what_the_seven_lists_said():
    assert ROLES == ("policy", "rollout", "reference", "critic", "reward")   # placement.roles, workflow ROLES
    assert DEFAULT_ROLES == GRPO
    assert [k.name for k in ROLE_KINDS if k.trained] == ["policy", "critic"]
    assert [k.name for k in ROLE_KINDS if k.restart == "stage"] == ["rollout", "reference", "reward", "extra"]
    assert [k.name for k in ROLE_KINDS if k.stateful] == ["policy", "rollout", "critic"]
    assert kind_of("teacher") is EXTRA and kind_of("policy").name == "policy"


def test_a_trained_kind_must_checkpoint_its_shards_and_restart_at_run_level():
    from raygraph.config.role_kinds import RoleKind

    with pytest.raises(ValueError, match="a trained role"):
        RoleKind("judge", trained=True, checkpoint=None, restart="stage", side="train")


def test_colocated_plan_fuses_every_role_on_one_pool_and_moves_weights_in_process(tmp_path):
    cfg = _cfg(tmp_path, "placement.mode=colocated", "actor.kl_loss_coef=0.1")
    plan = placement_plan(cfg, GRPO)
    assert set(plan.pools) == {"main"} and plan.pools == pools_for(cfg)
    assert plan.fused == (("policy", "rollout", "reference", "reward"),)
    assert plan.weight_sync == (("policy", "rollout"),) and plan.weights_move("policy", "rollout") == "in_process"
    specs = role_specs(cfg, GRPO)
    assert {r: (s.pool, s.world_size) for r, s in specs.items()} == plan.roles
    assert {r for r, s in specs.items() if s.distributed} == {"policy"}   # an unsharded reference: no group
    assert set(stateless_roles(specs)) == {"rollout", "reference", "reward"}


def test_disaggregated_plan_never_fuses_a_synced_pair(tmp_path):
    cfg = _cfg(tmp_path, "placement.mode=disaggregated", "placement.train_workers=2",
               "placement.rollout_workers=1", "data.prompts_per_step=4", "actor.kl_loss_coef=0.1",
               "reference.shard=true")
    plan = placement_plan(cfg, GRPO)
    assert set(plan.pools) == {"train", "rollout"}
    assert plan.roles == {"policy": ("train", 2), "rollout": ("rollout", 1), "reference": ("train", 2),
                          "reward": ("rollout", 1)}
    assert plan.fused == (("policy", "reference"), ("rollout", "reward"))
    assert plan.weights_move("policy", "rollout") == "collective"
    assert role_specs(cfg, GRPO)["reference"].distributed   # sharded: in a torch.distributed group


def test_the_vllm_engine_holds_the_longest_request_a_run_sends_unless_set(tmp_path):
    # the model's own context (8192 for SmolLM2) would size the KV cache and, with chunked prefill
    # off on the CPU build, the warm-up and every scheduler step: the run's longest request does
    vllm = ["rollout.engine=vllm", "data.max_prompt_length=100", "rollout.max_new_tokens=28"]
    assert WORKER_ARGS["rollout"](_cfg(tmp_path, *vllm), "rollout")["max_model_len"] == 128
    assert WORKER_ARGS["rollout"](_cfg(tmp_path, *vllm, "rollout.max_model_len=512"), "rollout")["max_model_len"] == 512
