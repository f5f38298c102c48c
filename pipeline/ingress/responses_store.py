"""The responses an ingress keeps for `previous_response_id`: the last `capacity` responses'
conversations (their input items and output items), least recently used dropped first.

Each entry is bounded: a conversation whose items take more than `max_bytes` as JSON (the
request body limit) is kept only as that fact, so continuing it is a 400 that says why rather
than a body larger than any client could have sent. The store is this process's memory: another
replica behind the router does not have it, and a restart forgets it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from pagedserve.pipeline.ingress.errors import APIError, invalid

DEFAULT_CAPACITY = 256
_ENCODER = msgspec.json.Encoder()


class ResponseStore:
    def __init__(self, max_bytes: int, capacity: int = DEFAULT_CAPACITY) -> None:
        self.max_bytes = max_bytes
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]] | int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, items: list[dict[str, Any]]) -> None:
        """Keep `items` (input then output) under `response_id`; at most `capacity` entries."""
        size = len(_ENCODER.encode(items))
        self._items[response_id] = items if size <= self.max_bytes else size
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation of a kept response; a 404 when it is not kept."""
        found = self._items.get(response_id)
        if found is None:
            raise APIError(404, f"Previous response with id '{response_id}' not found: this "
                                f"server keeps the last {self.capacity} responses in memory, "
                                "on the replica that answered them", param="previous_response_id",
                           code="previous_response_not_found")
        self._items.move_to_end(response_id)
        if isinstance(found, int):
            raise invalid(f"the conversation of response '{response_id}' takes {found} bytes, "
                          f"more than --max-request-bytes ({self.max_bytes}): send its items "
                          "as input instead", "previous_response_id")
        return list(found)
