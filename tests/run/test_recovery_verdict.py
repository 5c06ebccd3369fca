"""Which failures wait for Ray's verdict on a death, and which roles a restart loses nothing of
(no Ray instance: fake role groups and specs)."""

from __future__ import annotations

from raygraph.cluster import RoleSpec
from raygraph.run.recovery import find_dead_actors, node_death_bound_s
from raygraph.run.stage_recovery import stateless_roles
from raygraph.workers.policy import PolicyWorker
from raygraph.workers.reference import ReferenceWorker


class _Roles:
    """`dead_actors()` answers [] until its `verdict_after`-th call (Ray still calls the node alive)."""

    def __init__(self, verdict_after: int):
        self.calls, self.verdict_after = 0, verdict_after

    def dead_actors(self) -> list[str]:
        self.calls += 1
        return ["run/policy/1"] if self.calls > self.verdict_after else []


def test_a_vanished_collective_peer_waits_for_ray_to_name_the_dead_actor():
    roles = _Roles(verdict_after=2)
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:736")
    assert find_dead_actors(roles, gloo) == ["run/policy/1"] and roles.calls == 3


def test_a_plain_exception_is_not_waited_for():
    roles = _Roles(verdict_after=2)
    assert find_dead_actors(roles, ValueError("bad reward")) == [] and roles.calls == 1


def test_an_actor_that_lost_its_env_host_is_not_waited_for():
    """The rollout actor names itself unusable (EnvHostDied) and its cause quotes the host's
    ActorUnavailableError: no run actor died, so waiting for Ray's verdict would only cost the
    whole bound (65 s, which the env-host chaos run spent before this)."""
    from raygraph.cluster import RoleError
    from raygraph.cluster.errors import CallSite

    roles = _Roles(verdict_after=2)
    exc = RoleError(CallSite("rollout", 0, "run/rollout+reward/0"), "generate", "...",
                    "EnvHostDied: the env host 1 died during a step (ActorUnavailableError: "
                    "The actor is temporarily unavailable)")
    assert find_dead_actors(roles, exc) == [] and roles.calls == 1


def test_the_wait_is_bounded_by_rays_node_death_detection():
    assert node_death_bound_s() == 5 * (10 + 3)   # Ray's defaults: 5 missed checks, 10 s timeout, 3 s apart


def test_frozen_extra_roles_count_as_stateless_like_the_reference():
    specs = {"policy": RoleSpec(PolicyWorker), "reference": RoleSpec(ReferenceWorker),
             "teacher": RoleSpec(ReferenceWorker), "rollout": RoleSpec(object), "reward": RoleSpec(object)}
    assert set(stateless_roles(specs)) == {"reference", "teacher", "rollout", "reward"}


def test_an_unreachable_actor_is_not_called_dead_but_a_dead_one_names_itself():
    """Ray's ActorUnavailableError is a RayActorError, yet the actor may be alive: its RoleError
    says unavailable (wait for the verdict); a dead actor's error names the actor that stage-level
    recovery restarts even while a new ping to it goes unanswered (a lost node)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from raygraph.cluster.errors import ACTOR_DIED, CallSite, to_role_error
    from raygraph.run.stage_recovery import _dead_by_its_error

    site = CallSite("rollout", 0, "exp/run/rollout+reward/0")
    unavailable = to_role_error(ActorUnavailableError("the node is unreachable", None), site, "generate")
    died = to_role_error(ActorDiedError(), site, "generate")
    assert unavailable.cause == "ActorUnavailableError" and died.cause == ACTOR_DIED
    assert _dead_by_its_error(unavailable) == [] and _dead_by_its_error(died) == ["exp/run/rollout+reward/0"]
    assert _dead_by_its_error(ValueError("a bug")) == []
