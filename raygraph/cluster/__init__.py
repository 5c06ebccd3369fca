"""The Ray layer: resource pools, role groups (plain workers turned into actors), weight sync.

    pools = {"train": PoolSpec(bundles=2, cpus_per_bundle=1.0)}
    specs = {"policy": RoleSpec(factory=PolicyWorker, kwargs={...}, world_size=2, pool="train",
                                distributed=True), ...}
    roles = build_roles(run_name="exp/run1", pools=pools, specs=specs, mode="colocated",
                        colocate=[("policy", "rollout", "reference")])
    roles.policy.call("save_checkpoint", path)
    roles.shutdown()

See docs/runtime.md.
"""

from raygraph.cluster.errors import PlacementError, RoleError, WeightSyncError
from raygraph.cluster.pools import PoolSpec
from raygraph.cluster.roles import RoleGroup, Roles, RoleSpec, build_roles
from raygraph.cluster.weights import CollectiveTransport, InProcessTransport, WeightTransport

__all__ = ["PoolSpec", "RoleSpec", "RoleGroup", "Roles", "build_roles", "RoleError", "PlacementError",
           "WeightSyncError", "WeightTransport", "InProcessTransport", "CollectiveTransport"]
