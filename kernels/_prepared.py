"""A step's native calls prepared once for every layer (decode attention, RoPE + KV store).

The per-step tensors a call is prepared over (block tables, slots, cos/sin) are the same objects
for every layer of a step, so a dict that lives as long as the step (AttentionMetadata's
`prepared_calls`) keeps each preparation under those tensors' ids. An entry holds the tensors
themselves, so their ids cannot be reused by others while it lives; a call is prepared again
when the tensors are other objects or the layer's tensors do not fit it.
"""
from __future__ import annotations

from collections.abc import Callable
from operator import is_
from typing import Any


def prepared_call(prepared: dict, tensors: tuple, extra: tuple, fits: tuple,
                  build: Callable[[], Any]) -> Any:
    """The call kept in `prepared` for these `tensors` (by identity) and `extra` when it
    `fits(*fits)`; else `build()`'s, stored (unless None: nothing to prepare)."""
    key = (*map(id, tensors), *extra)
    entry = prepared.get(key)   # (*tensors, call)
    if entry is not None and all(map(is_, entry, tensors)) \
            and entry[-1].fits(*fits):
        return entry[-1]
    call = build()
    if call is not None:
        prepared[key] = (*tensors, call)
    return call
