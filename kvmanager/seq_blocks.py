"""The KV manager's records: its statistics and one sequence's blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.kvmanager.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class KVStats:
    gpu_blocks_used: int
    gpu_blocks_total: int
    cpu_blocks_used: int
    cpu_blocks_total: int
    usage: float                # gpu_blocks_used / gpu_blocks_total
    prefix_queries: int         # prompt tokens looked up by successful allocations
    prefix_hits: int            # of those, tokens served from the prefix cache

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(slots=True)
class SeqBlocks:
    block_ids: list[int]            # device ids, or host ids while swapped
    num_tokens: int                 # slots reserved
    cache_salt: str | None
    block_hashes: list[BlockHash] = field(default_factory=list)  # of its leading full blocks
    row: int = -1                   # row in the shared block tables, -1 without them
    swapped: bool = False
    # Leading entries of block_ids released out of the sliding window (kvmanager/window.py):
    # placeholders, old device ids that hold no reference.
    num_released: int = 0
