"""The executors that run a lowered graph once per training step. The only `ray.dag` import.

Two executors run the same plan (`raygraph.graph.lowering`): "interpreted" submits `.remote()`
calls in dependency order (every task also returns a tiny status, so the first failure anywhere
is raised at once as a `RoleError`), "compiled" lowers the plan to a Ray Compiled Graph
(`experimental_compile`). The driver sends the input and receives only the outputs (small
dicts), never a batch; `Executor.last_driver_bytes` measures it.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import TYPE_CHECKING, Any

import ray
import ray.dag as rdag
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelTimeoutError

from raygraph.cluster.errors import ACTOR_DIED, CallSite, RoleError, to_role_error, wait_calls
from raygraph.graph.lowering import INPUT, lower
from raygraph.graph.nodes import DAGNode

if TYPE_CHECKING:
    from raygraph.cluster.roles import Roles

__all__ = ["Executor", "EXECUTOR_MODES"]

EXECUTOR_MODES = ("interpreted", "compiled")
_COMPILED_ACTORS: dict[str, int] = {}   # actor id hex -> id() of the live compiled Executor using it


class Executor:
    """Runs a DAG once per `run(x)` over running role groups; returns the list of output values.

    Args:
        dag: a `MultiOutputNode` (or a single node), built with a `GraphBuilder`.
        roles: the running role groups (`raygraph.cluster.build_roles`) the graph's roles name.
        mode: "interpreted" (default: `.remote()` calls in dependency order, fail-fast errors)
            or "compiled" (Ray Compiled Graph).
        timeout_s: bound on one run (None: unbounded).
        fuse: run a plan whose role steps all live in one actor as one task there
            (`fuse_single_actor`; off only to see every stage as its own Ray task, for profiling).

    Attributes:
        last_driver_bytes: serialized bytes of what the driver received in the last run.
        last_input_bytes: serialized bytes of the input the driver sent in the last run.
    """

    def __init__(self, dag: DAGNode, roles: Roles, mode: str = "interpreted", timeout_s: float | None = None,
                 fuse: bool = True):
        if mode not in EXECUTOR_MODES:
            raise ValueError(f"executor mode must be one of {EXECUTOR_MODES}, got {mode!r}")
        self.mode, self.timeout_s = mode, timeout_s
        self.plan = lower(dag, roles, fuse=fuse)
        self.last_driver_bytes = self.last_input_bytes = 0
        self._compiled = self._compile() if mode == "compiled" else None

    def run(self, x: Any) -> list[Any]:
        self.last_input_bytes = _nbytes(x)
        return self._run_compiled(x) if self._compiled is not None else self._run_interpreted(x)

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
            task = dataclasses.replace(op.task, status=True)
            refs = op.actor.run.options(num_returns=task.n_out + 1, name=task.label).remote(
                task, *[values[v] for v in op.inputs])
            for i in range(task.n_out):
                values[(op.id, i)] = refs[i]
            status.append(refs[-1])
            sites.append(op.site)
            labels.append(task.label)
        try:
            oks = wait_calls(status, sites, labels, timeout_s=self.timeout_s)
            outs = ray.get([values[v] for v in self.plan.outputs])
        except RoleError as err:
            _read_echoes([*status, *values.values()])
            raise self._attribute(err) from None
        self.last_driver_bytes = _nbytes(oks) + _nbytes(outs)
        return outs

    def _run_one_task(self, x: Any) -> list[Any]:
        """A fused plan: one call, its results are the outputs (no status values to watch)."""
        op = self.plan.ops[0]
        refs = op.actor.run.options(num_returns=op.task.n_out, name=op.task.label).remote(op.task, x)
        refs = refs if op.task.n_out > 1 else [refs]
        try:
            outs = wait_calls(refs, [op.site] * len(refs), [op.task.label] * len(refs), timeout_s=self.timeout_s)
        except RoleError as err:
            _read_echoes(refs)
            raise self._attribute(err) from None
        self.last_driver_bytes = _nbytes(outs)
        return outs

    def _attribute(self, err: RoleError) -> RoleError:
        # A dead actor poisons every downstream step; name the actor that actually died.
        for hex_id, site in self.plan.sites.items():
            if hex_id in err.remote_traceback and err.cause.startswith(ACTOR_DIED):
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
                if op.task.n_out > 1:
                    method = method.options(num_returns=op.task.n_out)
                node = method.bind(op.task, *[nodes[v] for v in op.inputs])
                outs = list(node) if op.task.n_out > 1 else [node]
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


def _read_echoes(refs: list, within_s: float = 2.0) -> None:
    """Read the results a failed step's other tasks have left by now. Every task downstream of the
    failure fails with an echo of it, and Ray prints each error nobody read as an "Unhandled
    error" with its whole chain when its ref goes (two dozen tracebacks of one failure); the
    failure itself is raised once, as a `RoleError`."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=within_s, fetch_local=False)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001, S110 - an echo of the failure being raised
            pass
