"""The router's state of its replicas and its routing decision, with no sockets and no clock.

A replica is one engine group (one OpenAI endpoint) serving one model. `pick` chooses among
the model's healthy replicas by prefix affinity with a load bound (`affinity.choose`);
`begin`/`end` keep each replica's outstanding tokens and requests, the load the bound reads.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.pipeline.router.affinity import Choice, HashRing, choose


@dataclass(slots=True)
class Replica:
    replica_id: str
    model: str
    url: str                     # the engine group's base URL, http://host:port
    healthy: bool = False
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    max_model_len: int = 0       # from its /v1/models (0: not known yet)
    upstream_model: str = ""     # the model name the engine serves under
    capabilities: tuple[str, ...] = ()  # from its /v1/models (chat, tools, insert, ...)
    # sent with every request: a local group's secret (LocalGroup.headers); none to remotes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    load_factor: float = 1.25    # a replica may hold this many times the mean load
    load_floor: int = 512        # ... and never less than this many outstanding tokens
    affinity: bool = True        # False: round robin (the benchmark's baseline)


class NoReplica(LookupError):
    """No healthy replica serves the model (yet)."""


class RouterCore:
    def __init__(self, policy: RoutingPolicy = RoutingPolicy()):
        self.policy = policy
        self.replicas: dict[str, Replica] = {}
        self._rings: dict[str, HashRing] = {}
        self._round_robin: dict[str, int] = {}

    def add(self, replica: Replica) -> None:
        """A replica joins its model's ring once healthy; added unhealthy until then."""
        if replica.replica_id in self.replicas:
            raise ValueError(f"replica {replica.replica_id!r} exists already")
        self.replicas[replica.replica_id] = replica
        self._rings.setdefault(replica.model, HashRing())
        if replica.healthy:
            self._rings[replica.model].add(replica.replica_id)

    def remove(self, replica_id: str) -> Replica | None:
        replica = self.replicas.pop(replica_id, None)
        if replica is not None:
            self._rings[replica.model].remove(replica_id)
        return replica

    def set_healthy(self, replica_id: str, healthy: bool) -> bool:
        """True when this changed the replica's health."""
        replica = self.replicas.get(replica_id)
        if replica is None or replica.healthy == healthy:
            return False
        replica.healthy = healthy
        ring = self._rings[replica.model]
        (ring.add if healthy else ring.remove)(replica_id)
        return True

    def of_model(self, model: str, *, healthy_only: bool = True) -> list[Replica]:
        return [r for r in self.replicas.values()
                if r.model == model and (r.healthy or not healthy_only)]

    def pick(self, model: str, key: bytes, cost: int, exclude: Iterable[str] = ()) -> Choice:
        """Raises NoReplica when no healthy replica of `model` is left outside `exclude`."""
        skip = set(exclude)
        candidates = {r.replica_id: r.outstanding_tokens for r in self.of_model(model)
                      if r.replica_id not in skip}
        if not candidates:
            raise NoReplica(f"no healthy replica serves model {model!r}")
        if not self.policy.affinity:
            ordered = sorted(candidates)
            turn = self._round_robin.get(model, 0)
            self._round_robin[model] = turn + 1
            return Choice(ordered[turn % len(ordered)], False)
        return choose(self._rings[model], key, candidates, cost,
                      factor=self.policy.load_factor, floor=self.policy.load_floor)

    def begin(self, replica_id: str, cost: int) -> None:
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.outstanding_tokens += cost
            replica.outstanding_requests += 1

    def end(self, replica_id: str, cost: int) -> None:
        """Safe after the replica was removed."""
        replica = self.replicas.get(replica_id)
        if replica is not None:
            replica.outstanding_tokens = max(0, replica.outstanding_tokens - cost)
            replica.outstanding_requests = max(0, replica.outstanding_requests - 1)
