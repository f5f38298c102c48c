"""Prefix-cache affinity: the prompt's first blocks hash to a point on a consistent-hash ring
of the model's replicas; the first replica clockwise takes the request unless its load is over
the bound (consistent hashing with bounded loads), then the least-loaded replica does.

Pure: no clock, no sockets. Loads are outstanding tokens (prompt estimate + tokens still to
generate) per replica, kept by `RouterCore`.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

CHARS_PER_TOKEN = 4  # the router has no tokenizer: a text's tokens are estimated from its length


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(prompt: str | Sequence[int], *, block_size: int, num_blocks: int) -> bytes:
    """The identity of a prompt's first `num_blocks` blocks: token ids as they are, text as
    `block_size * CHARS_PER_TOKEN` characters per block. A prompt shorter than that is its own
    key (a short prompt gains little from the cache anyway)."""
    if isinstance(prompt, str):
        head = prompt[:block_size * CHARS_PER_TOKEN * num_blocks].encode("utf-8", "surrogatepass")
        return b"t" + hashlib.blake2b(head, digest_size=16).digest()
    head = b",".join(str(int(t)).encode() for t in prompt[:block_size * num_blocks])
    return b"i" + hashlib.blake2b(head, digest_size=16).digest()


class HashRing:
    """Replicas at `vnodes` pseudo-random points each; a key belongs to the first point at or
    after its own hash. Adding or removing one replica moves only the keys of its points."""

    def __init__(self, replica_ids: Iterable[str] = (), vnodes: int = 64):
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()
        for rid in replica_ids:
            self.add(rid)

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, replica_id: str) -> None:
        """Idempotent: a member is not added twice."""
        if replica_id in self._members:
            return
        self._members.add(replica_id)
        for v in range(self.vnodes):
            point = _point(f"{replica_id}#{v}".encode())
            i = bisect.bisect_left(self._points, point)
            self._points.insert(i, point)
            self._owners.insert(i, replica_id)

    def remove(self, replica_id: str) -> None:
        if replica_id not in self._members:
            return
        self._members.discard(replica_id)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != replica_id]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def owner(self, key: bytes) -> str | None:
        """The replica a key belongs to; None for an empty ring."""
        if not self._points:
            return None
        i = bisect.bisect_left(self._points, _point(key)) % len(self._points)
        return self._owners[i]


@dataclass(frozen=True, slots=True)
class Choice:
    replica_id: str
    affinity: bool  # True: the key's owner took it; False: it spilled to the least loaded


def load_bound(loads: Mapping[str, int], cost: int, factor: float, floor: int) -> int:
    """The most outstanding tokens one replica may hold after taking `cost` more: `factor`
    times the mean after the request, but never below `floor` (an idle system never spills)."""
    mean = (sum(loads.values()) + cost) / max(1, len(loads))
    return max(floor, math.ceil(mean * factor))


def choose(ring: HashRing, key: bytes, loads: Mapping[str, int], cost: int, *,
           factor: float = 1.25, floor: int = 512) -> Choice:
    """The key's owner when its load plus `cost` stays within the bound, else the least-loaded
    replica (ties by id). `loads` holds exactly the replicas that may take the request."""
    if not loads:
        raise LookupError("no replica may take the request")
    owner = ring.owner(key)
    if owner in loads and loads[owner] + cost <= load_bound(loads, cost, factor, floor):
        return Choice(owner, True)
    least = min(loads, key=lambda rid: (loads[rid], rid))
    return Choice(least, least == owner)
