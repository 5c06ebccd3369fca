"""The typed step report every graph ends with, the facts read off a graph, and the errors base.

What the driver acts on (weight version, KL for the adaptive controller, prompt batches used,
sample rows) comes back in a `StepReport`, never as keys of the metrics; a setting the graph
cannot honour is refused when the graph is built."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import numpy as np
import pytest
import torch

import raygraph
from raygraph.batch import PROMPT_BATCHES_USED, RESPONSE_MASK, TOKEN_LEVEL_SCORES, UID, Batch
from raygraph.config import load_config
from raygraph.config.workflow_ref import load_workflow
from raygraph.errors import RaygraphError
from raygraph.graph import GraphBuildError, step_metrics, whole_batch
from raygraph.graph.nodes import ApplyNode, MultiOutputNode
from raygraph.graph.report import StepReport, graph_facts, split_report, step_report
from raygraph.run.graphs import build_graphs

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "configs" / "grpo_toy.yaml")

# A user workflow that computes its own advantages (no compute_advantages node) and applies no
# DAPO shaping: settings that need either must be refused for it.
_OWN_ADVANTAGES = '''
from raygraph import batch as columns
from raygraph.graph import InputNode, MultiOutputNode, step_metrics

ROLES = ("policy", "rollout", "reward")


def score_as_advantage(batch):
    mask = batch[columns.RESPONSE_MASK].float()
    return batch.with_columns(**{columns.ADVANTAGES: batch[columns.TOKEN_LEVEL_SCORES].sum(-1, keepdim=True) * mask})


def build(roles, cfg):
    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)
        batch = roles.apply(score_as_advantage, roles.gather(rollouts, roles.reward.bind("score", rollouts)))
        update = roles.policy.bind("update", batch)
        return MultiOutputNode([roles.gather(update), roles.sync_weights(after=update),
                                roles.apply(step_metrics.rollout_metrics, batch)])
'''


def _graphs(overrides):
    cfg = load_config(TOY, list(overrides))
    return build_graphs(cfg, load_workflow(cfg.workflow))


def _own_workflow(tmp_path) -> str:
    path = tmp_path / "own_advantages.py"
    path.write_text(_OWN_ADVANTAGES)
    return f"workflow={path}:build"


def test_every_graph_ends_with_a_report_node_fed_by_the_batches_and_syncs_that_carry_its_facts():
    step, val = _graphs([])
    for graph in (step, val):
        assert isinstance(graph, MultiOutputNode)
        report = graph.outputs[-1]
        assert isinstance(report, ApplyNode) and report.fn is step_report
    fed = {getattr(n, "fn", None) for n in step.outputs[-1].args}
    assert whole_batch.compute_advantages in fed      # the KL of the advantage batch
    assert type(step.outputs[-1].args[-1]).__name__ == "SyncNode"   # the weight version


def test_the_report_reads_version_kl_batches_used_and_rows_from_its_inputs():
    rows = Batch({TOKEN_LEVEL_SCORES: torch.tensor([[1.0], [0.0]]), RESPONSE_MASK: torch.ones(2, 1)},
                 {UID: np.array(["a", "b"], dtype=object)}, {"kl_in_reward": 0.25, "kl_coef": 0.1,
                                                              step_metrics.DUMP_ROWS: 1})
    shaped = Batch(dict(rows.tensors), dict(rows.non_tensors), {PROMPT_BATCHES_USED: 3})
    report = step_report(rows, shaped, {"weights/version": 7.0, "weights/bytes": 10.0}, n_batches=2)
    assert report == StepReport(weight_version=7, kl_in_reward=0.25, prompt_batches=3,
                                records=[{"uid": "a", "score": 1.0}])
    # no sync in the graph: no version (the driver keeps its own); no facts: the defaults
    assert step_report(n_batches=0) == StepReport(weight_version=None, kl_in_reward=None, prompt_batches=1)
    outputs, got = split_report([{"m": 1.0}, report])
    assert outputs == [{"m": 1.0}] and got is report
    with pytest.raises(TypeError, match="no step report"):
        split_report([{"m": 1.0}])


def test_a_workflow_that_computes_no_kl_is_refused_with_the_adaptive_controller(tmp_path):
    adaptive = ["algorithm.kl_in_reward.controller=adaptive", "algorithm.kl_in_reward.coef=0.1"]
    _graphs(adaptive)   # the grpo workflow computes it (compute_advantages)
    with pytest.raises(GraphBuildError, match="controller is adaptive .* has no kl_in_reward"):
        _graphs([_own_workflow(tmp_path), *adaptive])


@pytest.mark.parametrize("setting, needs", [
    ("algorithm.mask_truncated=true", "mask_truncated"),
    ("algorithm.overlong_penalty.buffer=4", "overlong_penalty"),
    ("algorithm.dynamic_sampling.enabled=true", "filter_groups"),
])
def test_dapo_options_are_honoured_by_every_grpo_family_workflow_and_refused_elsewhere(tmp_path, setting, needs):
    for workflow in ("grpo", "rloo", "reinforce_pp"):   # rloo and reinforce_pp reuse grpo's graph
        advantage = {"rloo": "rloo", "reinforce_pp": "reinforce_pp"}.get(workflow, "grpo")
        step, _ = _graphs([f"workflow={workflow}", f"algorithm.advantage={advantage}", setting])
        assert needs in graph_facts(step).applies
    with pytest.raises(GraphBuildError, match=f"graph has no {needs}"):
        _graphs([_own_workflow(tmp_path), setting])


def test_every_public_error_class_is_a_raygraph_error():
    """The CLI prints a RaygraphError's message and exits with its code; every error class
    raygraph exports must be one (RemoteFailure wraps a remote traceback inside cluster/errors)."""
    found = []
    for info in pkgutil.walk_packages(raygraph.__path__, "raygraph."):
        if info.name.startswith("raygraph.workflows"):
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == module.__name__:
                found.append(obj)
    outside = sorted(c.__name__ for c in found if not issubclass(c, RaygraphError))
    assert outside == ["RemoteFailure", "RunStopped"], outside
    assert len(found) >= 15
