"""The Ray runtime: resource pools, role groups (plain workers turned into actors), weight sync.

It knows nothing about graphs: `raygraph.graph` lowers a workflow's graph into actor tasks
(`raygraph.cluster.tasks`) that the actors created here run.

    pools = {"train": PoolSpec(bundles=2, cpus_per_bundle=1.0)}
    specs = {"policy": RoleSpec(factory=PolicyWorker, kwargs={...}, world_size=2, pool="train",
                                distributed=True), ...}
    roles = build_roles(run_name="exp/run1", pools=pools, specs=specs,
                        colocate=[("policy", "rollout", "reference")], weight_sync=[("policy", "rollout")])
    roles.policy.call("save_checkpoint", path)
    roles.weights.sync_now()                 # policy -> rollout, outside any graph
    roles.shutdown()

See docs/runtime.md.
"""

from raygraph.cluster.collective_transport import CollectiveTransport
from raygraph.cluster.errors import PlacementError, RoleError, WeightSyncError
from raygraph.cluster.pools import PoolSpec
from raygraph.cluster.roles import RoleGroup, Roles, RoleSpec, build_roles
from raygraph.cluster.weight_sync import WeightSync
from raygraph.cluster.weights import InProcessTransport, WeightTransport

__all__ = ["PoolSpec", "RoleSpec", "RoleGroup", "Roles", "build_roles", "RoleError", "PlacementError",
           "WeightSyncError", "WeightSync", "WeightTransport", "InProcessTransport", "CollectiveTransport"]
