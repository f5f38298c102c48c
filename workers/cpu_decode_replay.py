"""CPU steps of few tokens replayed natively: every kernel call of a step of N token rows recorded
once per N, over static buffers, and made by one native call (kernels/native_replay.py).

The eager forward of a small model on a CPU spends as much time in Python as in its kernels:
SmolLM2-135M's 30 layers make ~300 native calls a token, each behind a wrapper that checks its
tensors, allocates its output and converts its arguments (~10-40 us apiece against kernels of a
few). Here the same kernels are called with the same arguments in the same order, so a replayed
step computes the eager step's logits and cache bit for bit (tests/workers/test_cpu_decode_replay.py);
only the Python between them is gone.

A step's rows are its tokens, decode rows first: decodes, a speculative step's drafts, a short
prefill chunk. On CPU the eager forward already attends every row as a decode query over its own
sequence's blocks up to its own position (models/attention.py: a decode call for single-token
sequences, one for the other rows), and that kernel's result for a row depends on the row alone,
so the replay attends all rows in one call. Like the CUDA graphs (cuda_graphs.py) a recorded step
reads its inputs from static buffers: each step writes its embeddings, RoPE rows, slots, each
row's block table and context there. The partition cap of each layer's attention, which the eager
call derives from the longest context, is the one argument set per step. The LM head and the
sampler stay eager (one call each).

What is replayed: one rank (no all-reduce), fp32 activations, a model made of the plain pre-norm
`DecoderLayer` with RMSNorm and SiLU and no q/k norms (Llama, Mistral, Qwen2, SmolLM2), native
elementwise, RoPE + store and decode attention kernels, an fp32 or bf16 cache, and every linear
on a native kernel (GGUF blocks, packed fp32 panels, --quantization int8). Anything else runs
eagerly; `unsupported_reason` says why. PAGEDSERVE_CPU_DECODE_REPLAY=0 turns it off.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedserve import envs, kernels
from pagedserve.kernels import native, native_elementwise
from pagedserve.kernels import native_decode_attention as attention
from pagedserve.kernels import native_replay as replay
from pagedserve.kernels.native_linear_gguf import PackedWeight
from pagedserve.kernels.native_rope_store import supports as rope_store_supports
from pagedserve.workers.models.causal_lm import DecoderForCausalLM
from pagedserve.workers.models.decoder import DecoderLayer
from pagedserve.workers.models.layers import (PackableLinear, RMSNorm, native_cpu_elementwise,
                                              silu_and_mul)

MAX_ROWS = 64       # steps of up to this many token rows replay
_ROPE_FORMATS = {torch.float32: 0, torch.bfloat16: 1}
_LINEAR_KINDS = (replay.GGUF_LINEAR, replay.GGUF_PACKED, replay.LINEAR_F32, replay.LINEAR_Q8)
_ATTENTION_KINDS = (replay.ROPE_STORE, replay.DECODE)


def _linear_reason(name: str, linear: PackableLinear) -> str | None:
    if linear.quantized is not None:
        if any(getattr(w, "perm", None) is not None for _, w in linear.quantized.stored):
            return f"{name} reorders its input columns"
        return None
    if linear.q8 is not None or (linear.panels is not None
                                 and linear.panels.dtype == torch.float32):
        return None
    return f"{name} has no native fp32 kernel here (not packed, or packed for oneDNN)"


def unsupported_reason(model: torch.nn.Module, kv_cache: torch.Tensor) -> str | None:
    """Why decode steps of this model cannot replay; None when they can."""
    if not isinstance(model, DecoderForCausalLM) or type(model).forward is not \
            DecoderForCausalLM.forward or type(model).embed is not DecoderForCausalLM.embed:
        return f"{type(model).__name__} is not the plain decoder"
    if model.tp.size != 1:
        return "tensor parallel ranks all-reduce between kernels"
    if model.dtype != torch.float32 or kv_cache.device.type != "cpu":
        return f"a {model.dtype} model on {kv_cache.device.type} (replayed: float32 on CPU)"
    if kv_cache.dtype not in _ROPE_FORMATS:
        return f"a {kv_cache.dtype} KV cache (replayed: float32, bfloat16)"
    if not (native_cpu_elementwise() and native_elementwise.available() and replay.available()
            and kernels.native_decode_rows(torch.empty(1, 1, 1), kv_cache[0, 0])
            and rope_store_supports(torch.empty(1, 2), kv_cache[0, 0])):
        return "a native kernel it needs is off or does not load"
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if type(layer).forward is not DecoderLayer.forward or type(layer.input_layernorm) \
                is not RMSNorm or layer.mlp.act_and_mul is not silu_and_mul \
                or attn.q_norm is not None:
            return f"layer {i} is not a pre-norm RMSNorm/SiLU layer without q/k norms"
        for name, linear in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj),
                             ("down_proj", layer.mlp.down_proj)):
            reason = _linear_reason(f"layer {i} {name}", linear)
            if reason:
                return reason
    if type(model.norm) is not RMSNorm:
        return "the final norm is not RMSNorm"
    return None


class _Buffers:
    """The static tensors a recorded step reads and writes, `rows` rows each."""

    def __init__(self, model: DecoderForCausalLM, rows: int, max_blocks: int) -> None:
        config, attn, mlp = model.config, model.layers[0].self_attn, model.layers[0].mlp
        h, d = config.hidden_size, attn.head_dim

        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(*shape, dtype=dtype)
        self.residual, self.normed, self.out = zeros(rows, h), zeros(rows, h), zeros(rows, h)
        self.proj, self.mlp_out = zeros(rows, h), zeros(rows, h)
        self.qkv = zeros(rows, attn.qkv_proj.weight.shape[0])
        self.q = zeros(rows, attn.num_heads * d)
        self.attn = zeros(rows, attn.num_heads * d)
        self.gate_up = zeros(rows, mlp.gate_up_proj.weight.shape[0])
        self.act = zeros(rows, mlp.gate_up_proj.weight.shape[0] // 2)
        self.cos = [zeros(rows, d // 2) for _ in model.ropes.tables]
        self.sin = [zeros(rows, d // 2) for _ in model.ropes.tables]
        self.slots = torch.full((rows,), -1, dtype=torch.int64)
        self.tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
        self.context_lens = torch.ones(rows, dtype=torch.int32)
        self.workspace = zeros(rows * attention.MAX_PARTS * attn.num_heads * (d + 2))


class CpuDecodeReplay:
    """Steps of up to `max_rows` token rows, each row count recorded on first use."""

    def __init__(self, model: DecoderForCausalLM, kv_cache: torch.Tensor, max_blocks: int,
                 max_rows: int = MAX_ROWS) -> None:
        reason = unsupported_reason(model, kv_cache)
        if reason is not None:
            raise ValueError(f"CPU decode replay: {reason}")
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"CPU decode replay needs max_rows and max_blocks >= 1, got "
                             f"{max_rows} and {max_blocks}")
        self.model, self.kv_cache = model, kv_cache
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.buffers = _Buffers(model, max_rows, max_blocks)
        self.block_size = kv_cache.shape[3]
        self.part_tokens = max(1, attention.PART_TOKENS // self.block_size) * self.block_size
        self.windows = sorted({layer.self_attn.window for layer in model.layers})
        # by (rows, threads, attention threads, build variant): the program and its attention
        # ops by window
        self._programs: dict[tuple[int, int, int, str], tuple[replay.Program, dict]] = {}
        self.seconds: np.ndarray | None = None   # set: per-kind op times are added (traces)

    def fits(self, rows: int, width: int) -> bool:
        """Whether a step of `rows` token rows over block tables `width` wide replays (under the
        current settings: one changed since the runner was built sends the step back to the
        eager path)."""
        settings = envs.current()
        return 1 <= rows <= self.max_rows and width <= self.max_blocks \
            and settings.cpu_decode_replay and settings.native_elementwise \
            and settings.decode_cpu == "native"

    @torch.inference_mode()
    def run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            tables: np.ndarray) -> torch.Tensor:
        """The final hidden states [rows, hidden] (norm applied) of one step: row r computes
        tokens[r] at positions[r] into slots[r], attending to its sequence's keys 0 ..
        positions[r] through block table tables[r] (the caller's rows in the eager forward's
        order). A view of a static buffer, valid until the next run."""
        rows, width = tables.shape
        if not self.fits(rows, width):
            raise ValueError(f"CPU decode replay: a step of {rows} rows x {width} blocks does "
                             f"not fit {self.max_rows} x {self.max_blocks}")
        b, model = self.buffers, self.model
        b.residual[:rows] = model.embed(torch.from_numpy(tokens))
        pos = torch.from_numpy(positions)
        for table, cos, sin in zip(model.ropes.tables, b.cos, b.sin):
            torch.index_select(table.cos, 0, pos, out=cos[:rows])
            torch.index_select(table.sin, 0, pos, out=sin[:rows])
        b.slots[:rows] = torch.from_numpy(slots)
        b.tables[:rows, :width] = torch.from_numpy(tables)
        b.context_lens[:rows] = torch.from_numpy(positions + 1)
        program, by_window = self._program(rows)
        longest = int(positions.max()) + 1
        for window, ops in by_window.items():
            program.set_arg(ops, 20, self._max_parts(longest, window))
        program.run(self.seconds)
        return b.out[:rows]

    def take_seconds(self) -> dict[str, float]:
        """Milliseconds since the last take in the replay's linears and attention (rope + store
        and the attention kernel), for the step trace; zeros until `seconds` is set."""
        s = self.seconds
        if s is None:
            return {"matmul_ms": 0.0, "attention_ms": 0.0}
        out = {"matmul_ms": float(s[list(_LINEAR_KINDS)].sum()) * 1e3,
               "attention_ms": float(s[list(_ATTENTION_KINDS)].sum()) * 1e3}
        s[:] = 0.0
        return out

    def _max_parts(self, longest: int, window: int) -> int:
        """The partition cap the eager call passes (native_decode_attention.DecodeCall). A row's
        partitions follow from its own context alone, so this only bounds the tasks."""
        if window > 0:
            longest = min(longest, window + self.block_size - 1)
        return max(min(attention.MAX_PARTS, -(-longest // self.part_tokens)), 1)

    def _program(self, rows: int) -> tuple[replay.Program, dict]:
        key = (rows, torch.get_num_threads(), attention._thread_count(), native.variant())
        found = self._programs.get(key)
        if found is None:
            found = self._programs[key] = _Recorder(self, rows).record()
        return found


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class _Recorder:
    """Records the step of one row count: the calls the eager forward makes, in its order."""

    def __init__(self, owner: CpuDecodeReplay, rows: int) -> None:
        self.owner, self.rows, self.b = owner, rows, owner.buffers
        self.threads = torch.get_num_threads()
        self.program = replay.Program()
        self.attention_ops: dict[int, list[int]] = {w: [] for w in owner.windows}

    def record(self) -> tuple[replay.Program, dict]:
        model, b = self.owner.model, self.b
        for i, layer in enumerate(model.layers):
            self._layer(i, layer)
        self._norm("final norm", b.mlp_out, b.residual, model.norm, b.out)
        ops = {w: np.array(v, dtype=np.int64) for w, v in self.attention_ops.items()}
        return self.program, ops

    def _layer(self, i: int, layer: DecoderLayer) -> None:
        b, attn, mlp = self.b, layer.self_attn, layer.mlp
        if i == 0:   # the embeddings are the residual stream; the first norm adds nothing
            self._norm("layer 0 input_layernorm", b.residual, None, layer.input_layernorm,
                       b.normed)
        else:
            self._norm(f"layer {i} input_layernorm", b.mlp_out, b.residual,
                       layer.input_layernorm, b.normed)
        self._linear(f"layer {i} qkv_proj", attn.qkv_proj, b.normed, b.qkv)
        self._rope_store(i, attn)
        self._decode(i, attn)
        self._linear(f"layer {i} o_proj", attn.o_proj, b.attn, b.proj)
        self._norm(f"layer {i} post_attention_layernorm", b.proj, b.residual,
                   layer.post_attention_layernorm, b.normed)
        self._linear(f"layer {i} gate_up_proj", mlp.gate_up_proj, b.normed, b.gate_up)
        self.program.add(replay.SILU_MUL, f"layer {i} silu_mul", _ptr(b.gate_up),
                         b.gate_up.shape[1], self.rows, b.act.shape[1], _ptr(b.act),
                         b.act.shape[1], self.threads)
        self._linear(f"layer {i} down_proj", mlp.down_proj, b.act, b.mlp_out)

    def _norm(self, name: str, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
              out: torch.Tensor) -> None:
        width = x.shape[1]
        self.program.add(replay.RMS_NORM, name, _ptr(x), width,
                         None if residual is None else _ptr(residual), 0 if residual is None
                         else width, _ptr(norm.weight), replay.F32(norm.eps), self.rows, width,
                         _ptr(out), width, self.threads)

    def _linear(self, name: str, linear: PackableLinear, x: torch.Tensor,
                out: torch.Tensor) -> None:
        """The eager matmul's calls (PackableLinear.matmul), then its bias."""
        m, k, ldo, add = self.rows, x.shape[1], out.shape[1], self.program.add
        if linear.quantized is not None:
            for offset, w in linear.quantized.stored:
                dst = _ptr(out) + 4 * offset
                if isinstance(w, PackedWeight):
                    add(replay.GGUF_PACKED, name, int(w.qtype), _ptr(w.data), w.n, w.k,
                        _ptr(x), m, k, dst, ldo, self.threads)
                else:
                    add(replay.GGUF_LINEAR, name, int(w.qtype), _ptr(w.data), w.shape[0], w.k,
                        w.data.stride(0), _ptr(x), m, k, dst, ldo, self.threads)
        elif linear.q8 is not None:
            q8 = linear.q8
            add(replay.LINEAR_Q8, name, _ptr(x), m, k, k, _ptr(q8.qweight), _ptr(q8.scales), q8.n,
                _ptr(out), ldo, self.threads)
        else:
            add(replay.LINEAR_F32, name, _ptr(x), m, k, k, _ptr(linear.panels), ldo, _ptr(out),
                ldo, self.threads)
        bias = getattr(linear, "bias", None)
        if bias is not None:
            add(replay.ADD_ROWS, f"{name} bias", _ptr(out), m, ldo, ldo, _ptr(bias))

    def _caches(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.owner.kv_cache
        return kv[i, 0], kv[i, 1]

    def _rope_store(self, i: int, attn) -> None:
        b, (k_cache, v_cache) = self.b, self._caches(i)
        table = self.owner.model.ropes.layer_table[i]
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
        stride = k_cache.stride()
        self.program.add(
            replay.ROPE_STORE, f"layer {i} rope_store", _ptr(b.qkv), 0, self.rows,
            b.qkv.shape[1], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            _ptr(b.cos[table]), _ptr(b.sin[table]), attn.head_dim // 2, _ptr(b.q),
            _ptr(k_cache), _ptr(v_cache), num_blocks * block_size, block_size, stride[0],
            stride[1], stride[2], _ptr(b.slots), _ROPE_FORMATS[k_cache.dtype], self.threads)

    def _decode(self, i: int, attn) -> None:
        b, (k_cache, v_cache) = self.b, self._caches(i)
        stride = k_cache.stride()
        kernel = replay.DECODE_KERNELS[str(k_cache.dtype).removeprefix("torch.")]
        fn = replay.address(attention.FEATURE, kernel)
        index = self.program.add(
            replay.DECODE, f"layer {i} decode attention", _ptr(b.q), _ptr(b.attn),
            _ptr(k_cache), _ptr(v_cache), stride[0], stride[1], stride[2], k_cache.shape[0],
            _ptr(b.tables), b.tables.stride(0), b.tables.shape[1], _ptr(b.context_lens),
            self.rows, attn.num_heads, attn.num_kv_heads, attn.head_dim, k_cache.shape[1],
            replay.F32(attn.scale), max(attn.window, 0), self.owner.part_tokens,
            attention.MAX_PARTS, _ptr(b.workspace), attention._thread_count(), fn=fn)
        self.attention_ops[attn.window].append(index)
