"""Resource pools: named placement groups of CPU/GPU bundles, created once per run."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from raygraph.cluster.errors import PlacementError

__all__ = ["PoolSpec", "create_pool", "remove_pool"]

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class PoolSpec:
    """A resource pool: `bundles` identical bundles of CPUs/GPUs, placed with `strategy`.

    Args:
        bundles: number of bundles (one role rank, or one fused actor, lives on a bundle).
        cpus_per_bundle: logical CPUs per bundle (fractions allowed, > 0).
        gpus_per_bundle: GPUs per bundle (0 on CPU-only machines).
        strategy: Ray placement strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
    """

    bundles: int
    cpus_per_bundle: float = 1.0
    gpus_per_bundle: float = 0.0
    strategy: str = "PACK"

    def __post_init__(self) -> None:
        if self.bundles < 1:
            raise ValueError(f"PoolSpec.bundles must be >= 1, got {self.bundles}")
        if self.cpus_per_bundle <= 0:
            raise ValueError(f"PoolSpec.cpus_per_bundle must be > 0, got {self.cpus_per_bundle}")
        if self.gpus_per_bundle < 0:
            raise ValueError(f"PoolSpec.gpus_per_bundle must be >= 0, got {self.gpus_per_bundle}")
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"PoolSpec.strategy must be one of {_STRATEGIES}, got {self.strategy!r}")

    def bundle(self) -> dict[str, float]:
        out = {"CPU": float(self.cpus_per_bundle)}
        if self.gpus_per_bundle:
            out["GPU"] = float(self.gpus_per_bundle)
        return out

    def describe(self) -> str:
        return f"{self.bundles} x {self.bundle()} ({self.strategy})"


def create_pool(name: str, spec: PoolSpec, timeout_s: float) -> PlacementGroup:
    """Create placement group `name` and wait at most `timeout_s` for it to be placed.

    Raises:
        PlacementError: naming what was asked and what the cluster has, after removing the
            pending group (so nothing stays queued behind a request that cannot be met).
    """
    pg = placement_group([spec.bundle() for _ in range(spec.bundles)], strategy=spec.strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if ready:
        return pg
    remove_placement_group(pg)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = "; ".join(f"{n['NodeManagerAddress']}: {_fmt(n.get('Resources', {}))}" for n in nodes)
    raise PlacementError(
        f"resource pool {name!r} could not be placed within {timeout_s:.0f}s: asked for "
        f"{spec.describe()}; the cluster has {_fmt(ray.cluster_resources())} in total, "
        f"{_fmt(ray.available_resources())} available; per node: {per_node}")


def remove_pool(pg: PlacementGroup) -> None:
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed, or Ray is shutting down
        pass


def _fmt(resources: dict) -> str:
    keep = {k: v for k, v in resources.items() if k in ("CPU", "GPU") or k.startswith("accelerator")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"
