"""CUDA graphs of decode-only steps: one graph per padded batch size, replayed instead of
launching the forward's kernels one by one.

A decode step of a small model is launch-bound on a GPU: SmolLM2-135M's 30 layers are ~450
kernel launches plus their Python, ~12 ms a step on an H200 at every batch size from 1 to 1,024
(scripts/cuda_check.py). A captured graph issues them all at once. The graph reads its inputs
from static buffers, so each step copies its token ids, positions, slots, block tables and
context lengths into them and pads the batch up to the next captured size: padded rows have slot
-1 (nothing is stored) and a context of one token (read from block 0, result unused).

Only decode-only steps (every sequence computes one token) replay; prefill and mixed steps run
eagerly. Capture needs the whole forward free of host synchronisation, which holds for the
Triton kernel path. On CPU (tests) `capture=False` runs the same padded forward eagerly, so the
padding and the static buffers are tested without a GPU.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.workers.models.attention import AttentionMetadata

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every multiple of 32, up to and including max_batch."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s < max_batch]
    sizes += range(64, max_batch, 32)
    return sorted(set(sizes) | {max_batch})


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, max_batch: int,
                 max_blocks_per_seq: int, *, capture: bool = True) -> None:
        if max_batch < 1 or max_blocks_per_seq < 1:
            raise ValueError(f"decode graphs need max_batch >= 1 and max_blocks_per_seq >= 1, "
                             f"got {max_batch} and {max_blocks_per_seq}")
        self.model, self.kv_cache = model, kv_cache
        self.sizes = graph_batch_sizes(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        n, device = self.sizes[-1], kv_cache.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._no_prefill_tables = torch.zeros(0, 1, dtype=torch.int32, device=device)
        self._no_prefill_cu = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_prefill_lens = torch.zeros(0, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def fits(self, num_seqs: int, table_width: int) -> bool:
        return num_seqs <= self.sizes[-1] and table_width <= self.max_blocks_per_seq

    def run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            tables: np.ndarray, context_lens: np.ndarray) -> torch.Tensor:
        """One decode step of len(tokens) sequences -> fp32 logits [n, vocab], valid until the
        next run of the same padded size."""
        n, width = tables.shape
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(torch.from_numpy(tokens))
        self.positions[:n].copy_(torch.from_numpy(positions))
        self.slots[:n].copy_(torch.from_numpy(slots))
        self.tables[:n, :width].copy_(torch.from_numpy(tables))
        self.context_lens[:n].copy_(torch.from_numpy(context_lens))
        # Rows n..size may hold an earlier, larger step's sequences: stop them storing K/V
        # (their slots may belong to live sequences now) and keep their attention to one token.
        self.slots[n:size].fill_(-1)
        self.context_lens[n:size].fill_(1)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], num_decode_tokens=size,
            decode_block_tables=self.tables[:size], decode_context_lens=self.context_lens[:size],
            prefill_block_tables=self._no_prefill_tables, prefill_cu_seqlens_q=self._no_prefill_cu,
            prefill_context_lens=self._no_prefill_lens)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
        # Not model.compute_logits: its reused buffers may be reallocated by a later eager step,
        # and a graph must own every address it writes.
        return self.model.cap_logits(F.linear(hidden, self.model.lm_head).float())

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start, pool = time.perf_counter(), None
        for size in reversed(self.sizes):           # largest first: the smaller reuse its pool
            for _ in range(2):                      # compile the Triton kernels, settle the allocator
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.sizes),
                 self.sizes[0], self.sizes[-1], time.perf_counter() - start)
