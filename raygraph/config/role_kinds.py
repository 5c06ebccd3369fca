"""The role kinds: what each role of a run is, in one table that every check, builder and
recovery path reads. A new kind (an environment, a judge) is one entry here, one worker table
entry (`raygraph.run.graphs`) and one argument builder (`raygraph.run.role_specs`), both keyed
by the kind's name; tests/run/test_role_kinds.py holds the three to the same names.

    kind        trained  checkpoint  restart  side     weights from
    policy      yes      shards      run      train    -
    rollout     no       ranks       stage    rollout  policy
    reference   no       -           stage    train    -
    critic      yes      shards      run      train    -
    reward      no       -           stage    rollout  -
    extra       no       -           stage    train    -       (each `extra_roles.<role>`)

It lives in `raygraph/config/` (no Ray, no worker import) so that the schema and its checks read
it as well as the driver; it holds facts only, the config -> worker classes and arguments
mapping stays with the builders above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RoleKind", "ROLE_KINDS", "ROLES", "DEFAULT_ROLES", "EXTRA", "kind_of", "weight_sync_pairs"]


@dataclass(frozen=True)
class RoleKind:
    """One kind of role.

    Args:
        name: the role's name (for `extra`: the kind of every role named in `extra_roles`).
        trained: updated by the step (an optimizer and its state); such a role is in a
            torch.distributed group and a checkpoint holds its shards.
        checkpoint: what a checkpoint holds of it: "shards" (every rank writes into
            `<ckpt>/<role>/`), "ranks" (one state per rank, `<ckpt>/<role>/rank<r>`, e.g. the
            rollout's sampling RNG), or None (weights it loads again, nothing else).
        restart: "stage": an actor hosting only such roles (and in no torch.distributed group)
            may be started again alone and the step rerun (`raygraph.run.stage_recovery`);
            "run": its loss goes to run-level recovery (a checkpoint reload).
        side: placed with the training ranks (`placement.train_workers`, the train pool) or the
            rollout ranks (`placement.rollout_workers`, the rollout pool) when disaggregated.
        weights_from: the role whose weights it receives after each update (a weight sync).
        builtin: started by its own name; False for `extra`, whose roles the config names.
        default: bound by a workflow that declares no ROLES.
    """

    name: str
    trained: bool
    checkpoint: Literal["shards", "ranks"] | None
    restart: Literal["stage", "run"]
    side: Literal["train", "rollout"]
    weights_from: str | None = None
    builtin: bool = True
    default: bool = False

    def __post_init__(self) -> None:
        if self.trained and (self.checkpoint != "shards" or self.restart != "run"):
            raise ValueError(f"role kind {self.name!r}: a trained role keeps its shards in checkpoints and "
                             "restarts at run level")

    @property
    def stateful(self) -> bool:
        """Holds state beyond its weights that a checkpoint restores."""
        return self.checkpoint is not None


EXTRA = RoleKind("extra", trained=False, checkpoint=None, restart="stage", side="train", builtin=False)

ROLE_KINDS: tuple[RoleKind, ...] = (   # this order is the order of a fused actor's roles (`policy+rollout`)
    RoleKind("policy", trained=True, checkpoint="shards", restart="run", side="train", default=True),
    RoleKind("rollout", trained=False, checkpoint="ranks", restart="stage", side="rollout", weights_from="policy",
             default=True),
    RoleKind("reference", trained=False, checkpoint=None, restart="stage", side="train"),
    RoleKind("critic", trained=True, checkpoint="shards", restart="run", side="train"),
    RoleKind("reward", trained=False, checkpoint=None, restart="stage", side="rollout", default=True),
    EXTRA,
)

_BY_NAME = {kind.name: kind for kind in ROLE_KINDS if kind.builtin}

# The built-in roles: what `placement.roles` and a workflow's ROLES may name besides `extra_roles`.
ROLES: tuple[str, ...] = tuple(_BY_NAME)
DEFAULT_ROLES: tuple[str, ...] = tuple(kind.name for kind in ROLE_KINDS if kind.default)


def kind_of(role: str) -> RoleKind:
    """The kind of a role the run starts: a built-in role's own, else `EXTRA` (a role the run
    starts under another name is one of `extra_roles`, which the config checks)."""
    return _BY_NAME.get(role, EXTRA)


def weight_sync_pairs(roles) -> tuple[tuple[str, str], ...]:
    """(src, dst) of every weight sync among `roles`: each role's `weights_from`, when both run."""
    return tuple((kind_of(r).weights_from, r) for r in roles if kind_of(r).weights_from in roles)
