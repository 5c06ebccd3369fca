"""The run's graphs, built from the config before any actor starts (also by `raygraph validate`,
which never imports Ray): which worker class plays each role, and the workflow's step graph and
the validation graph over those classes. A misspelt role or method fails here, in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

from raygraph.config import RaygraphConfig
from raygraph.config.role_kinds import ROLES, kind_of
from raygraph.config.workflow_ref import Workflow
from raygraph.graph import GraphBuilder, GraphBuildError
from raygraph.graph.fragments import validation_graph
from raygraph.graph.nodes import DAGNode
from raygraph.graph.report import GraphFacts, graph_facts, with_report
from raygraph.workers.critic import CriticWorker
from raygraph.workers.engines import ROLLOUT_ENGINES
from raygraph.workers.policy import PolicyWorker
from raygraph.workers.reference import ReferenceWorker
from raygraph.workers.reward_env import EnvRewardWorker
from raygraph.workers.reward_judge import JudgeRewardWorker
from raygraph.workers.reward_model import RewardModelWorker
from raygraph.workers.reward_remote import RemoteRewardWorker
from raygraph.workers.reward_rule import RuleRewardWorker

__all__ = ["WORKERS", "worker_classes", "build_graphs", "check_graph_honours"]

_REWARD_WORKERS = {"rule": RuleRewardWorker, "model": RewardModelWorker, "remote": RemoteRewardWorker,
                   "env": EnvRewardWorker, "judge": JudgeRewardWorker}
_TORCH = lambda cfg: "torch"   # noqa: E731 - a kind with one engine: plain PyTorch (FSDP2 when trained)

# Role kind (`raygraph.config.role_kinds`) -> (engine -> worker class, the config's choice of engine).
WORKERS: dict[str, tuple[dict[str, type], Callable[[RaygraphConfig], str]]] = {
    "policy": ({"torch": PolicyWorker}, _TORCH),
    "rollout": (ROLLOUT_ENGINES, lambda cfg: cfg.resolved_rollout_engine),
    "reference": ({"torch": ReferenceWorker}, _TORCH),
    "critic": ({"torch": CriticWorker}, _TORCH),
    "reward": (_REWARD_WORKERS, lambda cfg: cfg.reward.kind),
    "extra": ({"torch": ReferenceWorker}, _TORCH),   # a workflow's own frozen models (`extra_roles`)
}


def worker_classes(cfg: RaygraphConfig, role_names: tuple[str, ...]) -> dict[str, type]:
    """Role -> worker class for the roles a workflow binds (plus the reference with a KL term),
    in the order of the role kinds (then `extra_roles`).

    Raises:
        GraphBuildError: the workflow names a role raygraph does not have.
    """
    known = (*ROLES, *cfg.extra_roles)
    wanted = set(role_names) | ({"reference"} if cfg.uses_reference else set())
    if cfg.reference_from_policy:
        wanted.discard("reference")   # policy.ref_logprobs: the policy with its adapter disabled
    unknown = wanted - set(known)
    if unknown:
        raise GraphBuildError(f"workflow asks for unknown roles {sorted(unknown)}; known: {sorted(known)} (a role "
                         f"of the workflow's own is a frozen model given in extra_roles.<role>.model_path)")
    out = {}
    for name in (r for r in known if r in wanted):
        engines, choose = WORKERS[kind_of(name).name]
        out[name] = engines[choose(cfg)]
    return out


def build_graphs(cfg: RaygraphConfig, workflow: Workflow) -> tuple[DAGNode, DAGNode]:
    """(the workflow's per-step graph, the validation graph) over the config's worker classes,
    each with its `StepReport` appended (`raygraph.graph.report`).

    Raises:
        GraphBuildError: the workflow binds a role the run does not start or a method its worker
            lacks (the message names the valid ones), or its graph ignores a setting of the config
            (`check_graph_honours`).
    """
    builder = GraphBuilder(worker_classes(cfg, workflow.roles), absent=_absent_roles(cfg))
    rollout = cfg.rollout
    step = workflow.build_graph(builder, cfg)   # with the config's workflow_args
    check_graph_honours(cfg, graph_facts(step))
    val = validation_graph(builder, greedy=rollout.val_greedy, n=rollout.val_n, temperature=rollout.val_temperature)
    return with_report(step), with_report(val)


def _absent_roles(cfg: RaygraphConfig) -> dict[str, str]:
    """Roles a workflow may expect that this run does not start, with what to bind instead."""
    if cfg.reference_from_policy:
        return {"reference": "with model.lora the frozen base model is the reference and no reference role is "
                             "started; bind raygraph.graph.fragments.reference_logprobs(roles, cfg, batch) "
                             "(policy.ref_logprobs with the adapter disabled) instead of reference.logprobs"}
    return {}


def check_graph_honours(cfg: RaygraphConfig, facts: GraphFacts) -> None:
    """Settings that only a graph can honour, against what the workflow's graph does (derived
    from its nodes, so a workflow declares nothing): DAPO's shaping options need their functions
    in the graph, the adaptive KL controller needs the batch's KL from the advantages."""
    algo = cfg.algorithm
    needs = [("overlong_penalty", algo.overlong_penalty.buffer > 0, "algorithm.overlong_penalty.buffer > 0"),
             ("mask_truncated", algo.mask_truncated, "algorithm.mask_truncated is true"),
             ("filter_groups", algo.dynamic_sampling.enabled, "algorithm.dynamic_sampling.enabled is true"),
             ("kl_in_reward", algo.kl_in_reward.controller == "adaptive" and algo.kl_in_reward.coef > 0,
              "algorithm.kl_in_reward.controller is adaptive")]
    for what, on, setting in needs:
        if on:
            facts.require(what, f"{setting} (workflow {cfg.workflow!r})")
    if cfg.rollout.streaming and "rollout.stream_take" not in facts.calls:
        raise GraphBuildError(
            f"rollout.streaming is true, but the graph of workflow {cfg.workflow!r} does not take streamed rollouts "
            "(it never calls rollout.stream_take); grpo, rloo and reinforce_pp do (docs/streaming.md)")
    if facts.extra_prompt_batches and (cfg.placement.max_staleness or cfg.rollout.streaming):
        raise GraphBuildError(
            f"workflow {cfg.workflow!r} generates from {facts.extra_prompt_batches} extra prompt batches per step "
            f"(algorithm.dynamic_sampling.max_extra_rounds) with the current weights, which asynchronous pipelining "
            f"(placement.max_staleness={cfg.placement.max_staleness}) does not; set max_extra_rounds=0 (filter only) "
            "or placement.max_staleness=0")
