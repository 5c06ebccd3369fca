"""The run's graphs, built from the config before any actor starts (also by `raygraph validate`,
which never imports Ray): which worker class plays each role, and the workflow's step graph and
the validation graph over those classes. A misspelt role or method fails here, in seconds.
"""

from __future__ import annotations

from raygraph.config import RaygraphConfig
from raygraph.config.workflow_ref import Workflow
from raygraph.graph import GraphBuilder
from raygraph.graph.fragments import validation_graph
from raygraph.graph.nodes import DAGNode
from raygraph.workers.critic import CriticWorker
from raygraph.workers.policy import PolicyWorker
from raygraph.workers.reference import ReferenceWorker
from raygraph.workers.reward_model import RewardModelWorker
from raygraph.workers.reward_remote import RemoteRewardWorker
from raygraph.workers.reward_rule import RuleRewardWorker
from raygraph.workers.rollout_hf import HFRolloutWorker
from raygraph.workers.rollout_vllm import VLLMRolloutWorker

__all__ = ["worker_classes", "build_graphs"]

_REWARD_WORKERS = {"rule": RuleRewardWorker, "model": RewardModelWorker, "remote": RemoteRewardWorker}
_ROLLOUT_WORKERS = {"hf": HFRolloutWorker, "vllm": VLLMRolloutWorker}


def worker_classes(cfg: RaygraphConfig, role_names: tuple[str, ...]) -> dict[str, type]:
    """Role -> worker class for the roles a workflow binds (plus the reference with a KL term).

    Raises:
        ValueError: the workflow names a role raygraph does not have.
    """
    table = {"policy": PolicyWorker, "critic": CriticWorker, "reference": ReferenceWorker,
             "rollout": _ROLLOUT_WORKERS[cfg.rollout_engine], "reward": _REWARD_WORKERS[cfg.reward.kind],
             **{role: ReferenceWorker for role in cfg.extra_roles}}   # a workflow's own frozen models
    wanted = set(role_names) | ({"reference"} if cfg.uses_reference else set())
    if cfg.reference_from_policy:
        wanted.discard("reference")   # policy.ref_logprobs: the policy with its adapter disabled
    unknown = wanted - set(table)
    if unknown:
        raise ValueError(f"workflow asks for unknown roles {sorted(unknown)}; known: {sorted(table)} (a role "
                         f"of the workflow's own is a frozen model given in extra_roles.<role>.model_path)")
    return {name: cls for name, cls in table.items() if name in wanted}


def build_graphs(cfg: RaygraphConfig, workflow: Workflow) -> tuple[DAGNode, DAGNode]:
    """(the workflow's per-step graph, the validation graph) over the config's worker classes.

    Raises:
        GraphBuildError: the workflow binds a role the run does not start or a method its worker
            lacks (the message names the valid ones).
    """
    builder = GraphBuilder(worker_classes(cfg, workflow.roles))
    rollout = cfg.rollout
    step = workflow.build_graph(builder, cfg)   # with the config's workflow_args
    return step, validation_graph(builder, greedy=rollout.val_greedy, n=rollout.val_n,
                                  temperature=rollout.val_temperature)
