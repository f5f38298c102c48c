"""Which scheduling priority a client may ask for.

The engines run lower `priority` values first (`--scheduling-policy priority`, where a waiting
request may preempt running ones for it), so a client free to name any value could put its
requests ahead of every other key's. Each key has a floor, the lowest value it may ask for:
the fourth field of its spec (`KEY:RPM:TPM:PRIORITY`), else 0, the value of a request that names
none. A request asking for less than its key's floor runs at the floor; one asking for more
(less urgent) keeps its value; a floor above 0 also applies to requests that name no priority.
"""
from __future__ import annotations

from typing import Any

DEFAULT_PRIORITY_FLOOR = 0


def clamp_priority(body: dict[str, Any], floor: int) -> dict[str, Any]:
    """`body` with a priority no lower than `floor` (a new dict when it changes); ValueError
    for a priority that is not an integer (the engine's own check would take "-5" or -5.0)."""
    given = body.get("priority")
    if given is None:
        return {**body, "priority": floor} if floor > 0 else body
    if type(given) is not int:
        raise ValueError(f"priority must be an integer, got {type(given).__name__}")
    return body if given >= floor else {**body, "priority": floor}
