"""Lowering: a workflow's graph -> a plan of actor tasks over the running role groups.

A whole value consumed by a role is split on the coordinator actor (`Batch.chunk_by_group`), a
sharded value goes rank-to-rank when world sizes match and is re-split otherwise, and every
shard travels between actors by object reference. When every role task runs in ONE actor
(colocated roles, one rank), the plan is fused into a single task on that actor
(`fuse_single_actor`): the coordinator's work runs there too and the intermediate values never
leave its memory, so a step costs one task, not one per node, and the run starts no coordinator
actor at all (`Roles.coordinator` starts it on first use).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raygraph.cluster import tasks
from raygraph.cluster.actor_ids import actor_id
from raygraph.cluster.errors import CallSite
from raygraph.graph.builder import GraphBuildError
from raygraph.graph.nodes import (
    ApplyNode,
    CallNode,
    DAGNode,
    GatherNode,
    InputNode,
    MultiOutputNode,
    SyncNode,
)

if TYPE_CHECKING:
    from raygraph.cluster.roles import Roles

__all__ = ["Plan", "PhysOp", "lower", "fuse_single_actor"]

INPUT = tasks.INPUT
COORDINATOR_SITE = "coordinator"   # the key of the coordinator's ops in `Plan.sites` until it is bound


class _Coordinator:
    """Stands for the coordinator actor in a plan until the plan is known to need one (not fused)."""


@dataclass
class PhysOp:
    """One actor call: `actor.run(task, *[value of v for v in inputs])` with `task.n_out` results."""

    id: int
    actor: Any
    task: tasks.Task
    inputs: list[tuple]
    site: CallSite


@dataclass
class Plan:
    ops: list[PhysOp] = field(default_factory=list)
    outputs: list[tuple] = field(default_factory=list)
    sites: dict[str, CallSite] = field(default_factory=dict)   # actor id hex -> site
    fused: bool = False   # one task that runs the whole plan in one actor (`fuse_single_actor`)

    def describe(self) -> str:
        if self.fused:
            subs = self.ops[0].task.extra["ops"]
            return f"fused into {self.ops[0].site.actor_name}: " + ", ".join(sub.label for sub, _, _ in subs)
        return "\n".join(f"{op.id}: {op.site.actor_name or op.site.role} {op.task.label} <- {op.inputs}"
                         for op in self.ops)


class _Lowerer:
    def __init__(self, roles: Roles) -> None:
        self.roles = roles
        self.plan = Plan()
        self.memo: dict[int, list[tuple]] = {}          # id(node) -> value ids (1 if whole)
        self.resplit: dict[tuple[int, int], list[tuple]] = {}
        self.merged: dict[int, tuple] = {}
        self.uses_roles = False
        self.input: InputNode | None = None

    def emit(self, actor, task: tasks.Task, inputs: list[tuple], site: CallSite) -> list[tuple]:
        op = PhysOp(len(self.plan.ops), actor, task, inputs, site)
        self.plan.ops.append(op)
        self.plan.sites[COORDINATOR_SITE if isinstance(actor, _Coordinator) else actor_id(actor)] = site
        return [(op.id, i) for i in range(task.n_out)]

    def coordinator(self, task: tasks.Task, inputs: list[tuple]) -> list[tuple]:
        site = CallSite("coordinator", 0, f"{self.roles.run_name}/coordinator")
        return self.emit(_Coordinator(), task, inputs, site)

    def group(self, role: str):
        if role not in self.roles.groups:
            raise GraphBuildError(f"the graph calls role {role!r}, which this run did not start; "
                                  f"roles are {sorted(self.roles.groups)}")
        self.uses_roles = True
        return self.roles.groups[role]

    def visit(self, node: DAGNode) -> list[tuple]:
        if id(node) in self.memo:
            return self.memo[id(node)]
        for dep in node._deps():
            self.visit(dep)
        out = getattr(self, f"_lower_{type(node).__name__}")(node)
        self.memo[id(node)] = out
        return out

    def whole(self, node: DAGNode) -> tuple:
        """The value id of `node` as one whole value (gathering a sharded node once)."""
        vals = self.visit(node)
        if not node.sharded:
            return vals[0]
        if id(node) not in self.merged:
            self.merged[id(node)] = self.coordinator(tasks.Task("gather", groups=(len(vals),)), vals)[0]
        return self.merged[id(node)]

    def shards(self, node: DAGNode, world: int) -> list[tuple]:
        """`world` value ids for `node`, split (or re-split) on the coordinator when needed."""
        vals = self.visit(node)
        if (node.sharded and len(vals) == world) or (not node.sharded and world == 1):
            return vals
        key = (id(node), world)
        if key not in self.resplit:
            task = tasks.Task("scatter", n_out=world, groups=(len(vals),))
            self.resplit[key] = self.coordinator(task, vals)
        return self.resplit[key]

    def templates(self, args, kwargs, values_of: Callable[[DAGNode], tuple], inputs: list) -> tuple:
        def one(a):
            if isinstance(a, DAGNode):
                inputs.append(values_of(a))
                return tasks.Arg(index=len(inputs) - 1)
            return tasks.Arg(const=a)

        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    def _lower_InputNode(self, node: InputNode) -> list[tuple]:
        if self.input is not None and self.input is not node:
            raise ValueError("a DAG has exactly one InputNode")
        self.input = node
        return [INPUT]

    def _lower_CallNode(self, node: CallNode) -> list[tuple]:
        g = self.group(node.role)
        split = {id(d): self.shards(d, g.world_size) for d in node._deps()}
        out = []
        for rank, (actor, site) in enumerate(zip(g.actors, g.sites)):
            inputs: list[tuple] = []
            args, kwargs = self.templates(node.args, node.kwargs, lambda d, r=rank: split[id(d)][r], inputs)
            task = tasks.Task("call", role=g.name, method=node.method, rank=rank, args=args, kwargs=kwargs)
            out += self.emit(actor, task, inputs, site)
        return out

    def _lower_GatherNode(self, node: GatherNode) -> list[tuple]:
        vals = [self.visit(n) for n in node.inputs]
        flat = [v for vs in vals for v in vs]
        return self.coordinator(tasks.Task("gather", groups=tuple(len(vs) for vs in vals)), flat)

    def _lower_ApplyNode(self, node: ApplyNode) -> list[tuple]:
        inputs: list[tuple] = []
        args, kwargs = self.templates(node.args, node.kwargs, self.whole, inputs)
        task = tasks.Task("apply", method=node.fn.__name__, fn=node.fn, args=args, kwargs=kwargs)
        return self.coordinator(task, inputs)

    def _lower_SyncNode(self, node: SyncNode) -> list[tuple]:
        self.group(node.src)
        self.group(node.dst)
        after = self.visit(node.after) if node.after is not None else [INPUT]
        reports = []
        for actor, task, site in self.roles.weights.transfer_tasks(node.src, node.dst, **node.options):
            reports += self.emit(actor, task, list(after), site)
        return self.coordinator(tasks.Task("weights_combine", method="sync_weights"), reports)

    def _lower_MultiOutputNode(self, node: MultiOutputNode) -> list[tuple]:
        self.plan.outputs = [self.whole(n) for n in node.outputs]
        return []


def lower(dag: DAGNode, roles: Roles, *, fuse: bool = True) -> Plan:
    """The physical plan of `dag` over the running `roles` (tasks in dependency order).

    With `fuse`, a plan whose role tasks all run on ONE actor (colocated roles, one rank) becomes
    one task on that actor that runs every task in-process (`fuse_single_actor`).

    Raises:
        GraphBuildError: the graph calls a role that `roles` does not hold.
        ValueError: the graph has no input, or calls no role.
    """
    if not isinstance(dag, MultiOutputNode):
        dag = MultiOutputNode([dag])
    low = _Lowerer(roles)
    low.visit(dag)
    if low.input is None:
        raise ValueError("the DAG does not use its InputNode")
    if not low.uses_roles:
        raise ValueError("the DAG uses no role group")
    plan = fuse_single_actor(low.plan) if fuse else low.plan
    return plan if plan.fused else _bind_coordinator(plan, roles)


def _bind_coordinator(plan: Plan, roles: Roles) -> Plan:
    """`plan` with its whole-batch ops on the run's coordinator actor (started now if it is not yet)."""
    if COORDINATOR_SITE not in plan.sites:
        return plan
    actor = roles.coordinator
    for op in plan.ops:
        if isinstance(op.actor, _Coordinator):
            op.actor = actor
    plan.sites[actor_id(actor)] = plan.sites.pop(COORDINATOR_SITE)
    return plan


def fuse_single_actor(plan: Plan) -> Plan:
    """`plan` as ONE task on its only role actor, if all its role tasks run on one actor.

    The coordinator's tasks (scatter, gather, apply, the sync's combine) then run in that actor
    too, and every intermediate value stays in its memory: one task per step instead of one per
    node, no object-store copies, and the driver still sends the input and gets the outputs.
    Plans touching several role actors are returned unchanged.
    """
    role_ops = [op for op in plan.ops if op.task.op not in tasks.WHOLE_OPS]
    if not role_ops or len({actor_id(op.actor) for op in role_ops}) != 1:
        return plan
    host = role_ops[0]
    subs = tuple((op.task, tuple(op.inputs), tuple((op.id, i) for i in range(op.task.n_out)))
                 for op in plan.ops)
    task = tasks.Task("plan", method="fused", n_out=len(plan.outputs),
                      extra={"ops": subs, "outputs": tuple(plan.outputs)})
    fused = Plan(sites={actor_id(host.actor): host.site}, fused=True)
    fused.ops.append(PhysOp(0, host.actor, task, [INPUT], host.site))
    fused.outputs = [(0, i) for i in range(task.n_out)]
    return fused


