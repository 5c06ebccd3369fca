"""The per-step dataflow graph over role groups, and the executors that run it.

Workflows build a graph once per run::

    with InputNode() as prompts:
        rollouts = roles.rollout.bind("generate", prompts)    # sharded: one value per rank
        batch = roles.gather(rollouts, roles.reward.bind("score", rollouts))
        metrics = roles.policy.bind("update", batch)          # whole -> split by prompt group
        dag = MultiOutputNode([roles.gather(metrics), roles.sync_weights(after=metrics)])
    executor = Executor(dag)          # interpreted (default) or mode="compiled"
    outputs = executor.run(prompts_batch)

Nodes are either *whole* (one value: the input, gathers, applies, syncs) or *sharded* (one
value per rank of a role). Lowering turns the graph into a plan of physical steps on actors:
a whole value consumed by a role is split on the coordinator actor (`Batch.chunk_by_group`),
a sharded value goes rank-to-rank when world sizes match and is re-split otherwise, and every
shard travels between actors by object reference. The driver sends the input and receives only
the outputs (small dicts), never a batch; `Executor.last_driver_bytes` measures it.

When every role step runs in ONE actor (colocated roles, one rank), the plan is fused into a
single step on that actor (`fuse_single_actor`): the coordinator's work runs there too and the
intermediate values never leave its memory, so a step costs one task, not one per node.

Two executors run the same plan: "interpreted" submits `.remote()` calls in dependency order
(every step also returns a tiny status, so the first failure anywhere is raised at once as a
`RoleError`), "compiled" lowers the plan to a Ray Compiled Graph (`experimental_compile`).
This is the only module that imports `ray.dag`.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.dag as rdag
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelTimeoutError

from raygraph.cluster import steps as S
from raygraph.cluster.errors import CallSite, RoleError, to_role_error, wait_calls

__all__ = ["InputNode", "MultiOutputNode", "Executor", "DAGNode", "CallNode", "GatherNode",
           "ApplyNode", "SyncNode", "Plan", "lower"]

INPUT = S.INPUT
EXECUTOR_MODES = ("interpreted", "compiled")
_COMPILED_ACTORS: dict[str, int] = {}   # actor id hex -> id() of the live compiled Executor using it


class DAGNode:
    """A value in the per-step graph (whole, or sharded over a role's ranks)."""

    sharded = False
    roles = None

    def _deps(self) -> list[DAGNode]:
        return []


class InputNode(DAGNode):
    """The driver's per-step input (the prompts Batch). Use as `with InputNode() as prompts:`."""

    def __enter__(self) -> InputNode:
        return self

    def __exit__(self, *exc) -> None:
        return None


def _node_args(args: Sequence[Any], kwargs: dict[str, Any]) -> list[DAGNode]:
    return [a for a in [*args, *kwargs.values()] if isinstance(a, DAGNode)]


class CallNode(DAGNode):
    """`group.method(*args, **kwargs)` on every rank (sharded: one result per rank)."""

    sharded = True

    def __init__(self, group, method: str, args: Sequence[Any], kwargs: dict[str, Any]):
        self.group, self.method, self.args, self.kwargs = group, method, tuple(args), dict(kwargs)
        self.roles = group.roles

    def _deps(self) -> list[DAGNode]:
        return _node_args(self.args, self.kwargs)


class GatherNode(DAGNode):
    """One whole value from `inputs`: shards concatenated (dicts: per-key mean), inputs unioned."""

    def __init__(self, roles, inputs: Sequence[DAGNode]):
        if not inputs or not all(isinstance(n, DAGNode) for n in inputs):
            raise TypeError("gather takes one or more DAG nodes")
        self.roles, self.inputs = roles, tuple(inputs)

    def _deps(self) -> list[DAGNode]:
        return list(self.inputs)


class ApplyNode(DAGNode):
    """`fn(*args, **kwargs)` on whole values, run on the coordinator actor."""

    def __init__(self, roles, fn: Callable, args: Sequence[Any], kwargs: dict[str, Any]):
        if getattr(fn, "__name__", "<lambda>") == "<lambda>" or "<locals>" in getattr(fn, "__qualname__", ""):
            raise TypeError(f"apply needs a module-level function (picklable by reference), got {fn!r}")
        self.roles, self.fn, self.args, self.kwargs = roles, fn, tuple(args), dict(kwargs)

    def _deps(self) -> list[DAGNode]:
        return _node_args(self.args, self.kwargs)


class SyncNode(DAGNode):
    """Weight sync `src` -> `dst` after `after` is computed; value: the `weights/*` stats dict."""

    def __init__(self, roles, src: str, dst: str, after: DAGNode | None, **options: Any):
        self.roles, self.src, self.dst, self.after, self.options = roles, src, dst, after, options

    def _deps(self) -> list[DAGNode]:
        return [self.after] if self.after is not None else []


class MultiOutputNode(DAGNode):
    """The graph's outputs: a list of whole values (sharded outputs are gathered)."""

    def __init__(self, outputs: Sequence[DAGNode]):
        self.outputs = list(outputs)

    def _deps(self) -> list[DAGNode]:
        return list(self.outputs)


# --- lowering: graph -> plan of physical steps ------------------------------------------------------
@dataclass
class PhysOp:
    """One actor call: `actor.run(step, *[value of v for v in inputs])` with `step.n_out` results."""

    id: int
    actor: Any
    step: S.Step
    inputs: list[tuple]
    site: CallSite


@dataclass
class Plan:
    ops: list[PhysOp] = field(default_factory=list)
    outputs: list[tuple] = field(default_factory=list)
    sites: dict[str, CallSite] = field(default_factory=dict)   # actor id hex -> site
    fused: bool = False   # one step that runs the whole plan in one actor (`fuse_single_actor`)

    def describe(self) -> str:
        if self.fused:
            subs = self.ops[0].step.extra["ops"]
            return f"fused into {self.ops[0].site.actor_name}: " + ", ".join(sub.label for sub, _, _ in subs)
        return "\n".join(f"{op.id}: {op.site.actor_name or op.site.role} {op.step.label} <- {op.inputs}"
                         for op in self.ops)


class _Lowerer:
    def __init__(self) -> None:
        self.plan = Plan()
        self.memo: dict[int, list[tuple]] = {}          # id(node) -> value ids (1 if whole)
        self.resplit: dict[tuple[int, int], list[tuple]] = {}
        self.merged: dict[int, tuple] = {}
        self.roles = None
        self.input: InputNode | None = None

    def emit(self, actor, step: S.Step, inputs: list[tuple], site: CallSite) -> list[tuple]:
        op = PhysOp(len(self.plan.ops), actor, step, inputs, site)
        self.plan.ops.append(op)
        self.plan.sites[actor._actor_id.hex()] = site
        return [(op.id, i) for i in range(step.n_out)]

    def coordinator(self, step: S.Step, inputs: list[tuple]) -> list[tuple]:
        site = CallSite("coordinator", 0, f"{self.roles.run_name}/coordinator")
        return self.emit(self.roles.coordinator, step, inputs, site)

    def visit(self, node: DAGNode) -> list[tuple]:
        if id(node) in self.memo:
            return self.memo[id(node)]
        if node.roles is not None:
            if self.roles is not None and node.roles is not self.roles:
                raise ValueError("a DAG may only use role groups of one Roles object")
            self.roles = node.roles
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
            self.merged[id(node)] = self.coordinator(S.Step("gather", groups=(len(vals),)), vals)[0]
        return self.merged[id(node)]

    def shards(self, node: DAGNode, world: int) -> list[tuple]:
        """`world` value ids for `node`, split (or re-split) on the coordinator when needed."""
        vals = self.visit(node)
        if (node.sharded and len(vals) == world) or (not node.sharded and world == 1):
            return vals
        key = (id(node), world)
        if key not in self.resplit:
            step = S.Step("scatter", n_out=world, groups=(len(vals),))
            self.resplit[key] = self.coordinator(step, vals)
        return self.resplit[key]

    def templates(self, args, kwargs, values_of: Callable[[DAGNode], tuple], inputs: list) -> tuple:
        def one(a):
            if isinstance(a, DAGNode):
                inputs.append(values_of(a))
                return S.Arg(index=len(inputs) - 1)
            return S.Arg(const=a)

        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    def _lower_InputNode(self, node: InputNode) -> list[tuple]:
        if self.input is not None and self.input is not node:
            raise ValueError("a DAG has exactly one InputNode")
        self.input = node
        return [INPUT]

    def _lower_CallNode(self, node: CallNode) -> list[tuple]:
        g = node.group
        split = {id(d): self.shards(d, g.world_size) for d in node._deps()}
        out = []
        for rank, (actor, site) in enumerate(zip(g.actors, g.sites)):
            inputs: list[tuple] = []
            args, kwargs = self.templates(node.args, node.kwargs, lambda d, r=rank: split[id(d)][r], inputs)
            step = S.Step("call", role=g.name, method=node.method, rank=rank, args=args, kwargs=kwargs)
            out += self.emit(actor, step, inputs, site)
        return out

    def _lower_GatherNode(self, node: GatherNode) -> list[tuple]:
        vals = [self.visit(n) for n in node.inputs]
        flat = [v for vs in vals for v in vs]
        return self.coordinator(S.Step("gather", groups=tuple(len(vs) for vs in vals)), flat)

    def _lower_ApplyNode(self, node: ApplyNode) -> list[tuple]:
        inputs: list[tuple] = []
        args, kwargs = self.templates(node.args, node.kwargs, self.whole, inputs)
        step = S.Step("apply", method=node.fn.__name__, fn=node.fn, args=args, kwargs=kwargs)
        return self.coordinator(step, inputs)

    def _lower_SyncNode(self, node: SyncNode) -> list[tuple]:
        from raygraph.cluster.sync import sync_steps

        after = self.visit(node.after) if node.after is not None else [INPUT]
        reports = []
        for actor, step, site in sync_steps(node.roles, node.src, node.dst, **node.options):
            reports += self.emit(actor, step, list(after), site)
        return self.coordinator(S.Step("weights_combine", method="sync_weights"), reports)

    def _lower_MultiOutputNode(self, node: MultiOutputNode) -> list[tuple]:
        self.plan.outputs = [self.whole(n) for n in node.outputs]
        return []


def lower(dag: MultiOutputNode, *, fuse: bool = True) -> Plan:
    """The physical plan of `dag` (steps in dependency order).

    With `fuse`, a plan whose role steps all run on ONE actor (colocated roles, one rank) becomes
    one step on that actor that runs every step in-process (`fuse_single_actor`).
    """
    if not isinstance(dag, MultiOutputNode):
        dag = MultiOutputNode([dag])
    low = _Lowerer()
    low.visit(dag)
    if low.input is None:
        raise ValueError("the DAG does not use its InputNode")
    if low.roles is None:
        raise ValueError("the DAG uses no role group")
    return fuse_single_actor(low.plan) if fuse else low.plan


def fuse_single_actor(plan: Plan) -> Plan:
    """`plan` as ONE step on its only role actor, if all its role steps run on one actor.

    The coordinator's steps (scatter, gather, apply, the sync's combine) then run in that actor
    too, and every intermediate value stays in its memory: one task per step instead of one per
    node, no object-store copies, and the driver still sends the input and gets the outputs.
    Plans touching several role actors are returned unchanged.
    """
    role_ops = [op for op in plan.ops if op.step.op not in S.WHOLE_OPS]
    if not role_ops or len({op.actor._actor_id for op in role_ops}) != 1:
        return plan
    host = role_ops[0]
    subs = tuple((op.step, tuple(op.inputs), tuple((op.id, i) for i in range(op.step.n_out)))
                 for op in plan.ops)
    step = S.Step("plan", method="fused", n_out=len(plan.outputs),
                  extra={"ops": subs, "outputs": tuple(plan.outputs)})
    fused = Plan(sites={host.actor._actor_id.hex(): host.site}, fused=True)
    fused.ops.append(PhysOp(0, host.actor, step, [INPUT], host.site))
    fused.outputs = [(0, i) for i in range(step.n_out)]
    return fused


# --- executors -------------------------------------------------------------------------------------
class Executor:
    """Runs a DAG once per `run(x)`; returns the list of output values.

    Args:
        dag: a `MultiOutputNode` (or a single node).
        mode: "interpreted" (default: `.remote()` calls in dependency order, fail-fast errors)
            or "compiled" (Ray Compiled Graph).
        timeout_s: bound on one run (None: unbounded).
        fuse: run a plan whose role steps all live in one actor as one task there
            (`fuse_single_actor`; off only to see every stage as its own Ray task, for profiling).

    Attributes:
        last_driver_bytes: serialized bytes of what the driver received in the last run.
        last_input_bytes: serialized bytes of the input the driver sent in the last run.
        last_run_s: wall time of the last run.
    """

    def __init__(self, dag: DAGNode, mode: str = "interpreted", timeout_s: float | None = None,
                 fuse: bool = True):
        if mode not in EXECUTOR_MODES:
            raise ValueError(f"executor mode must be one of {EXECUTOR_MODES}, got {mode!r}")
        self.mode, self.timeout_s = mode, timeout_s
        self.plan = lower(dag, fuse=fuse)
        self.last_driver_bytes = self.last_input_bytes = 0
        self.last_run_s = 0.0
        self._compiled = self._compile() if mode == "compiled" else None

    def run(self, x: Any) -> list[Any]:
        start = time.perf_counter()
        self.last_input_bytes = _nbytes(x)
        outs = self._run_compiled(x) if self._compiled is not None else self._run_interpreted(x)
        self.last_run_s = time.perf_counter() - start
        return outs

    def teardown(self) -> None:
        if self._compiled is not None:
            self._compiled.teardown()
            self._compiled = None
            for hex_id in self.plan.sites:
                _COMPILED_ACTORS.pop(hex_id, None)

    # interpreted --------------------------------------------------------------------------------
    def _run_interpreted(self, x: Any) -> list[Any]:
        if self.plan.fused:
            return self._run_one_task(x)
        values: dict[tuple, Any] = {INPUT: ray.put(x)}
        status, sites, labels = [], [], []
        for op in self.plan.ops:
            step = dataclasses.replace(op.step, status=True)
            refs = op.actor.run.options(num_returns=step.n_out + 1, name=step.label).remote(
                step, *[values[v] for v in op.inputs])
            for i in range(step.n_out):
                values[(op.id, i)] = refs[i]
            status.append(refs[-1])
            sites.append(op.site)
            labels.append(step.label)
        try:
            oks = wait_calls(status, sites, labels, timeout_s=self.timeout_s)
            outs = ray.get([values[v] for v in self.plan.outputs])
        except RoleError as err:
            raise self._attribute(err) from None
        self.last_driver_bytes = _nbytes(oks) + _nbytes(outs)
        return outs

    def _run_one_task(self, x: Any) -> list[Any]:
        """A fused plan: one call, its results are the outputs (no status values to watch)."""
        op = self.plan.ops[0]
        refs = op.actor.run.options(num_returns=op.step.n_out, name=op.step.label).remote(op.step, x)
        refs = refs if op.step.n_out > 1 else [refs]
        try:
            outs = wait_calls(refs, [op.site] * len(refs), [op.step.label] * len(refs), timeout_s=self.timeout_s)
        except RoleError as err:
            raise self._attribute(err) from None
        self.last_driver_bytes = _nbytes(outs)
        return outs

    def _attribute(self, err: RoleError) -> RoleError:
        # A dead actor poisons every downstream step; name the actor that actually died.
        for hex_id, site in self.plan.sites.items():
            if hex_id in err.remote_traceback and err.cause.startswith("the actor died"):
                return RoleError(site, err.method, err.remote_traceback, err.cause)
        return err

    # compiled -----------------------------------------------------------------------------------
    def _compile(self):
        # Ray runs one compiled graph per actor at a time; a second one would time out opaquely.
        busy = [site.actor_name for hex_id, site in self.plan.sites.items() if hex_id in _COMPILED_ACTORS]
        if busy:
            raise RuntimeError(f"actors {busy} already belong to a live compiled graph; call teardown() on "
                               "that Executor first, or use mode='interpreted'")
        with rdag.InputNode() as inp:
            nodes: dict[tuple, Any] = {INPUT: inp}
            for op in self.plan.ops:
                method = op.actor.run
                if op.step.n_out > 1:
                    method = method.options(num_returns=op.step.n_out)
                node = method.bind(op.step, *[nodes[v] for v in op.inputs])
                outs = list(node) if op.step.n_out > 1 else [node]
                for i, n in enumerate(outs):
                    nodes[(op.id, i)] = n
            dag = rdag.MultiOutputNode([nodes[v] for v in self.plan.outputs])
        compiled = dag.experimental_compile()
        _COMPILED_ACTORS.update({hex_id: id(self) for hex_id in self.plan.sites})
        return compiled

    def _run_compiled(self, x: Any) -> list[Any]:
        ref = self._compiled.execute(x)
        try:
            # None would let Ray apply RAY_CGRAPH_get_timeout (10 s); -1 blocks.
            outs = ray.get(ref, timeout=-1 if self.timeout_s is None else self.timeout_s)
        except (GetTimeoutError, RayChannelTimeoutError):
            raise RoleError(CallSite("compiled graph", -1), "run", "",
                            f"no result within {self.timeout_s}s") from None
        except RayActorError as exc:
            raise self._attribute(to_role_error(exc, CallSite("?", -1), "compiled graph")) from None
        except Exception as exc:  # noqa: BLE001 - RemoteFailure -> RoleError
            raise to_role_error(exc, CallSite("?", -1), "compiled graph") from None
        self.last_driver_bytes = _nbytes(outs)
        return list(outs)


def _nbytes(value: Any) -> int:
    return len(pickle.dumps(value, protocol=5))
