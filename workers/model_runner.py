"""Model runner: owns one rank's model shard and KV cache; turns a step's per-sequence work into
flat tensors (once per step, vectorised) and returns the logits of the rows that sample."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from pagedserve import envs
from pagedserve.kernels import paths as kernel_paths
from pagedserve.kernels.kv_format import check_storage
from pagedserve.workers.cpu_decode_replay import CpuDecodeReplay
from pagedserve.workers.cpu_decode_replay import unsupported_reason as replay_unsupported
from pagedserve.workers.cuda_graphs import DecodeGraphs
from pagedserve.workers.distributed import TPGroup
from pagedserve.pipeline.pooling import PoolerConfig
from pagedserve.workers.heap import trim_heap
from pagedserve.workers.kv_cache import allocate_kv_cache, kv_cache_shape
from pagedserve.workers.loader import ModelConfig, iter_weights, weights_quantization
from pagedserve.workers.models import model_class
from pagedserve.workers.models.attention import AttentionMetadata
from pagedserve.workers.prompt_logprobs import RowLogprobs, prompt_logprobs
from pagedserve.workers.lora.setup import LoRASetup, lora_manager
from pagedserve.workers.pooling import pool_hidden
from pagedserve.workers.models.layers import (KEPT_QUANTIZED, check_quantization, prepack_linears,
                                              quantize_linears, release_packed_weights)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqStep:
    """What one sequence computes this step."""

    token_ids: list[int]       # the tokens to compute (a prefill chunk, or one decode token)
    start_pos: int             # position of token_ids[0] == tokens already in the cache
    block_table: list[int]     # covers at least start_pos + len(token_ids) slots
    sample: bool               # whether its last row's logits are wanted
    table_row: int = -1        # >= 0: take the block table from this row of shared_tables
    num_drafts: int = 0        # the last tokens are drafts: their rows' logits are wanted too
    # Prompt logprobs: the prompt tokens the first rows predict (row j: prompt_targets[j]),
    # and how many top logprobs each of those rows wants (workers/prompt_logprobs.py).
    prompt_targets: list[int] | None = None
    prompt_top: int = 0
    pool: bool = False         # the last chunk of an embedding prompt: pool its hidden states
    lora_id: int = 0           # its LoRA adapter's id (registered with runner.lora); 0: none


@dataclass(slots=True)
class StepOutput:
    """What one step returns: the logits of the sampling items (in item order), the pooled
    vectors of the pooling items (fp32 [num pooling items, hidden], in item order) and the
    prompt logprobs of the items that asked (by item index)."""

    logits: torch.Tensor
    pooled: torch.Tensor | None = None
    prompt: dict[int, RowLogprobs] = field(default_factory=dict)


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the flat batch whose logits are returned, in item order


@dataclass(slots=True)
class _StepArrays:
    """A step flattened on the host (sequences reordered: single-token ones first)."""
    tokens: np.ndarray        # [T] int64
    positions: np.ndarray     # [T] int64
    slots: np.ndarray         # [T] int64
    tables: np.ndarray        # [n, width] int32, in the reordered sequence order
    context_lens: np.ndarray  # [n] int32
    cu: np.ndarray            # [n + 1] int64 row offsets of the reordered sequences
    num_decode: int           # sequences (= rows) computing exactly one token
    sample_rows: np.ndarray   # rows whose logits are returned, in item order
    seq_of_row: np.ndarray    # [T] int64: the reordered sequence of each row
    first_rows: np.ndarray    # [n] int64: each item's first row, in item order
    pool_spans: np.ndarray    # [k, 2] int64 (first row, end row) of each pooling item, in order


class ModelRunner:
    # The scheduler's block tables (int32 [rows, width], read-only shared memory) when the
    # worker attached them: items with a table_row read their blocks there.
    shared_tables: np.ndarray | None = None

    def __init__(self, config: ModelConfig, model_dir: str | Path | None, dtype: torch.dtype,
                 device: torch.device | str, block_size: int, num_blocks: int,
                 tp_rank: int = 0, tp_size: int = 1,
                 kv_cache_dtype: torch.dtype | None = None, cuda_graph_batch: int = 256,
                 quantization: str = "none", cpu_replay: bool = True,
                 pooler: PoolerConfig | None = None, lora: LoRASetup | None = None) -> None:
        """`model_dir=None` gives random weights of the real shapes (benchmarks only).
        `kv_cache_dtype`: the cache's storage dtype (kernels/kv_format.py); None: `dtype`.
        `quantization`: auto (a quantized checkpoint's format kept as stored, else none), none
        (dequantized at load), int8 (CPU, fp32: kernels/native_linear_q8.py), or the
        checkpoint's format by name (gguf, awq, gptq).
        `cuda_graph_batch`: on CUDA with one rank, decode-only steps of up to this many
        sequences replay captured CUDA graphs (workers/cuda_graphs.py); 0: always eager.
        `cpu_replay`: on CPU, steps of up to cpu_decode_replay.MAX_ROWS tokens (decodes, drafts,
        short prefill chunks) replay their native kernel calls (workers/cpu_decode_replay.py)
        where the model allows and PAGEDSERVE_CPU_DECODE_REPLAY is on; False: always eager
        (--enforce-eager).
        `pooler`: how embedding requests pool (pipeline/pooling.py); None: the default for the
        model's kind (LAST for a decoder, CLS for an encoder, normalized).
        `lora`: LoRA slots and limits (--enable-lora; workers/lora/); None: no adapters."""
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.pooler = pooler or PoolerConfig("CLS" if config.is_encoder else "LAST")
        self.kv_cache_dtype = kv_cache_dtype or dtype
        check_storage("--kv-cache-dtype", dtype, self.kv_cache_dtype)  # fail at start, not step 1
        quantization = "none" if model_dir is None and quantization == "auto" else \
            quantization if model_dir is None else weights_quantization(quantization, model_dir)
        check_quantization(quantization, dtype, torch.device(device))
        self.quantization = quantization
        self.block_size, self.num_blocks = block_size, num_blocks
        self.tp = TPGroup(tp_rank, tp_size)
        self.model = model_class(config.architecture)(config, self.tp, dtype, self.device)
        if model_dir is None:
            _init_random(self.model, seed=0)
        else:
            self.model.load_weights(iter_weights(model_dir, dtype,
                                                 keep_quantized=quantization in KEPT_QUANTIZED))
            trim_heap()   # the parts of fused quantized weights, copied once into one tensor
        self.model.eval()
        if quantization == "int8":
            done, total = quantize_linears(self.model)
            log.info("--quantization int8: %d of %d linears in int8 (the rest have in_features "
                     "that are not whole blocks of 32)", done, total)
        if envs.current().prepack:
            prepack_linears(self.model)
            freed = release_packed_weights(self.model)
            if freed:
                trim_heap()
                log.info("packed linears: freed %.1f MiB of plain weights", freed / 2**20)
        self.lora = lora_manager(self.model, config, lora, dtype, self.device)
        if config.is_encoder:  # its attention reads no cache: blocks only count admissions
            self.kv_cache = torch.empty(kv_cache_shape(config, num_blocks, block_size, tp_size,
                                                       tp_rank), dtype=self.kv_cache_dtype,
                                        device="meta")
        else:
            self.kv_cache = allocate_kv_cache(config, num_blocks, block_size,
                                              self.kv_cache_dtype, self.device, tp_size, tp_rank)
        self.decode_graphs: DecodeGraphs | None = None
        max_blocks = -(-config.max_position_embeddings // block_size)   # a table row's width
        if self.device.type == "cuda" and tp_size == 1 and cuda_graph_batch > 0 \
                and not config.is_encoder:
            self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, cuda_graph_batch,
                                              max_blocks)
        self.cpu_replay: CpuDecodeReplay | None = None
        if self.device.type == "cpu" and cpu_replay and envs.current().cpu_decode_replay:
            reason = replay_unsupported(self.model, self.kv_cache)
            if reason is None:
                self.cpu_replay = CpuDecodeReplay(self.model, self.kv_cache, max_blocks)
            log.info("CPU decode replay rank %d: %s", tp_rank,
                     "on" if reason is None else f"off ({reason})")
        log.info("kernels rank %d (%s, %s, %s cache): %s", tp_rank, self.device.type, dtype,
                 self.kv_cache_dtype, kernel_paths.describe(kernel_paths.kernel_paths(
                     self.device, dtype, quantization, self.kv_cache_dtype, config.head_dim,
                     config.hidden_size)))
        log.info("model runner rank %d/%d: %s, %s, %s cache, %d blocks of %d tokens (%.1f MiB)",
                 tp_rank, tp_size, config.architecture, dtype, self.kv_cache_dtype, num_blocks,
                 block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    def execute(self, items: list[SeqStep]) -> torch.Tensor:
        """Compute every item's tokens; fp32 logits [num sampling items, vocab] in item order."""
        return self.run(items).logits

    @torch.inference_mode()
    def run(self, items: list[SeqStep]) -> StepOutput:
        """Compute every item's tokens: the sampling items' logits and the pooling items'
        vectors (workers/pooling.py), both in item order, and the prompt logprobs of the items
        with prompt_targets (workers/prompt_logprobs.py; computed from the hidden rows before
        the sampling rows' logits: compute_logits reuses its buffer)."""
        if not items:
            return StepOutput(torch.empty(0, self.config.vocab_size, device=self.device))
        arrays = self._flatten(items)
        adapted = self.lora is not None and self.lora.prepare_items(items, arrays.first_rows,
                                                                    len(arrays.tokens))
        try:
            return self._run(items, arrays, adapted)
        finally:
            if adapted:
                self.lora.finish_step()

    def _run(self, items: list[SeqStep], arrays: _StepArrays, adapted: bool) -> StepOutput:
        """`run` of the flattened step; `adapted`: some rows use LoRA adapters (eager only)."""
        pooling = len(arrays.pool_spans) > 0
        wanted = [i for i, it in enumerate(items) if it.prompt_targets]
        graphs = None if adapted else self.decode_graphs
        if graphs is not None and not wanted and not pooling \
                and arrays.num_decode == len(items) \
                and graphs.fits(len(items), arrays.tables.shape[1]):
            logits = graphs.run(arrays.tokens, arrays.positions, arrays.slots, arrays.tables,
                                arrays.context_lens)
            if len(arrays.sample_rows) < len(items):
                logits = logits[self._to_device(arrays.sample_rows)]
            return StepOutput(logits)
        if pooling:
            self._check_whole_prompts(items)
        # pooling reads every row's hidden state as the eager forward gives it
        hidden, sample_rows = self._hidden(items, arrays, eager=pooling or adapted)
        out = StepOutput(torch.empty(0, self.config.vocab_size, device=self.device))
        if pooling:
            out.pooled = pool_hidden(hidden, arrays.pool_spans, self.pooler)
        if wanted:
            out.prompt = dict(zip(wanted, prompt_logprobs(
                self.model.compute_logits, hidden,
                [(int(arrays.first_rows[i]), items[i].prompt_targets, items[i].prompt_top)
                 for i in wanted])))
        if len(arrays.sample_rows):
            out.logits = self.model.compute_logits(
                hidden if sample_rows is None else hidden[sample_rows])
        return out

    def _check_whole_prompts(self, items: list[SeqStep]) -> None:
        """MEAN and CLS pooling (and an encoder) read every prompt row in one step."""
        pooler = self.pooler
        if pooler.whole_prompt:
            partial = [i for i, it in enumerate(items) if it.pool and it.start_pos]
            if partial:
                raise ValueError(f"item {partial[0]}: {pooler.pooling_type} pooling needs the "
                                 f"whole prompt in one step, but it starts at position "
                                 f"{items[partial[0]].start_pos}")

    def _hidden(self, items: list[SeqStep], arrays: _StepArrays, eager: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward: the hidden states of every row, and the rows that sample
        (None: all of them, in item order). `eager`: never the CPU replay."""
        replay = self.cpu_replay
        if not eager and replay is not None \
                and replay.fits(len(arrays.tokens), arrays.tables.shape[1]):
            tables = arrays.tables if arrays.num_decode == len(items) \
                else arrays.tables[arrays.seq_of_row]            # each row's sequence's table
            hidden = replay.run(arrays.tokens, arrays.positions, arrays.slots, tables)
            if arrays.num_decode < len(items) or len(arrays.sample_rows) < len(items):
                return hidden, torch.from_numpy(arrays.sample_rows)  # item order, drafts
            return hidden, None
        step = self._tensors(arrays)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
        return hidden, step.sample_rows

    def prepare(self, items: list[SeqStep]) -> StepTensors:
        """Flatten the items, single-token sequences first, into the step's tensors."""
        return self._tensors(self._flatten(items))

    def _flatten(self, items: list[SeqStep]) -> _StepArrays:
        """The step as flat arrays, single-token sequences first."""
        n, bs = len(items), self.block_size
        lens = np.fromiter((len(it.token_ids) for it in items), np.int64, n)
        if (lens == 0).any():
            raise ValueError("a scheduled sequence has no tokens to compute")
        order = np.argsort(lens != 1, kind="stable")
        lens_o = lens[order]
        starts_o = np.fromiter((items[i].start_pos for i in order), np.int64, n)
        cu = np.zeros(n + 1, np.int64)
        np.cumsum(lens_o, out=cu[1:])
        total = int(cu[-1])
        tokens = np.fromiter(chain.from_iterable(items[i].token_ids for i in order), np.int64, total)

        rows_o = np.fromiter((items[i].table_row for i in order), np.int64, n)
        seq_of_row = np.repeat(np.arange(n), lens_o)
        positions = np.repeat(starts_o - cu[:-1], lens_o) + np.arange(total)
        block_index = positions // bs
        if self.shared_tables is not None and rows_o.min() >= 0:
            tables_o = self._shared_block_tables(rows_o, starts_o + lens_o, order)
        else:
            tables_o, num_table_blocks = _pad_block_tables([items[i].block_table for i in order])
            if (block_index >= num_table_blocks[seq_of_row]).any():
                bad = int(order[seq_of_row[np.argmax(block_index >= num_table_blocks[seq_of_row])]])
                raise ValueError(f"item {bad}: block table of {len(items[bad].block_table)} "
                                 f"blocks cannot hold position "
                                 f"{items[bad].start_pos + lens[bad] - 1} at block size {bs}")
        slots = tables_o[seq_of_row, block_index].astype(np.int64) * bs + positions % bs
        context_lens = (starts_o + lens_o).astype(np.int32)

        num_decode = int((lens == 1).sum())
        inverse = np.empty(n, np.int64)
        inverse[order] = np.arange(n)
        sample_mask = np.fromiter((it.sample for it in items), bool, n)
        sample_rows = (cu[inverse + 1] - 1)[sample_mask]
        if any(it.num_drafts for it in items):  # speculation: the drafts' rows too, in order
            counts = np.fromiter((it.num_drafts + 1 for it in items), np.int64, n)[sample_mask]
            sample_rows = np.repeat(sample_rows - counts + 1, counts) + _ramps(counts)
        pool_mask = np.fromiter((it.pool for it in items), bool, n)
        pool_spans = np.stack([cu[inverse], cu[inverse + 1]], axis=1)[pool_mask]
        return _StepArrays(tokens, positions, slots, tables_o, context_lens, cu, num_decode,
                           sample_rows, seq_of_row, cu[inverse], pool_spans)

    def _tensors(self, a: _StepArrays) -> StepTensors:
        to, d = self._to_device, a.num_decode
        meta = AttentionMetadata(
            slot_mapping=to(a.slots),
            num_decode_tokens=d,
            decode_block_tables=to(a.tables[:d]),
            decode_context_lens=to(a.context_lens[:d]),
            prefill_block_tables=to(a.tables[d:]),
            prefill_cu_seqlens_q=to((a.cu[d:] - a.cu[d]).astype(np.int32)),
            prefill_context_lens=to(a.context_lens[d:]))
        if self.device.type == "cpu" and len(a.tokens) > d:
            # Every row as a decode query over its causal prefix (attention.attend): the prefill
            # rows' tables and context lengths, built once for all layers.
            meta.prefill_row_tables = to(a.tables[a.seq_of_row[d:]])
            meta.prefill_row_context_lens = to((a.positions[d:] + 1).astype(np.int32))
        return StepTensors(to(a.tokens), to(a.positions), meta, to(a.sample_rows))

    def _shared_block_tables(self, rows: np.ndarray, context_lens: np.ndarray,
                             order: np.ndarray) -> np.ndarray:
        """int32 [n, width] block tables of the sequences in shared rows `rows`, each read up to
        the blocks its context needs (every one of those must be set), the rest padded with 0
        (never read: the context lengths stop before it)."""
        shared, bs = self.shared_tables, self.block_size
        needed = (context_lens + bs - 1) // bs
        width = int(needed.max())
        if rows.max() >= shared.shape[0] or width > shared.shape[1]:
            raise ValueError(f"shared block tables [{shared.shape[0]}, {shared.shape[1]}] have "
                             f"no row {int(rows.max())} or no {width} blocks per row")
        tables = shared[rows, :width]                  # a private copy of the rows' prefix
        wanted = np.arange(width) < needed[:, None]
        unset = (tables < 0) & wanted
        if unset.any():
            seq, index = np.argwhere(unset)[0]
            raise ValueError(f"item {int(order[seq])}: shared block table row {int(rows[seq])} "
                             f"has no block at index {int(index)} (context of "
                             f"{int(context_lens[seq])} tokens)")
        tables[~wanted] = 0
        return tables

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)


def _ramps(counts: np.ndarray) -> np.ndarray:
    """0, 1, .., c - 1 for each count c, concatenated."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum())) - starts


def _pad_block_tables(tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged block tables -> int32 [n, max_len] padded with block 0 (never read: the
    context lengths stop before it), plus each table's length."""
    n = len(tables)
    lengths = np.fromiter(map(len, tables), np.int64, n)
    width = max(int(lengths.max()), 1)
    flat = np.fromiter(chain.from_iterable(tables), np.int32, int(lengths.sum()))
    padded = np.zeros((n, width), np.int32)
    starts = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    rows = np.repeat(np.arange(n), lengths)
    padded[rows, np.arange(flat.size) - np.repeat(starts, lengths)] = flat
    return padded, lengths


@torch.no_grad()
def _init_random(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
