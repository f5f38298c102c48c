"""Tensor-parallel building blocks: head/row partitioning, rank-local linears, RMSNorm,
SiLU-and-mul (RoPE: rotary.py, re-exported here).

Each parallel linear owns only this rank's slice of the weight and knows how to cut that slice
out of the full Hugging Face tensor (`load`), so checkpoints are never re-sharded on disk.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import (native, native_elementwise, native_linear, native_linear_gguf,
                                native_linear_q8, paths)
from pagedserve.kernels.quant_formats import QuantizedWeight
# re-exported: the model and the worker ask these here
from pagedserve.kernels.paths import bf16_prepack_supported, native_cpu_elementwise  # noqa: F401
from pagedserve.pipeline.config import QUANTIZATIONS
from pagedserve.workers.heap import trim_heap
from pagedserve.workers.distributed import TPGroup
from pagedserve.workers.models.quantized import QuantizedMatmul


def even_split(n: int, parts: int, index: int) -> slice:
    """The `index`-th of `parts` contiguous pieces of range(n); the first n % parts get one more."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


@dataclass(frozen=True, slots=True)
class HeadPartition:
    """Which attention heads one rank computes: q heads `q_heads` (contiguous) and, for them, the
    kv heads `kv_heads` to hold (global ids, possibly repeated) such that local query head i uses
    local kv head i // (len(q_heads) // len(kv_heads)) — the GQA rule the kernels assume."""

    q_heads: range
    kv_heads: tuple[int, ...]


def partition_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadPartition:
    """Split heads over ranks, uneven splits allowed (SmolLM2 has 9 q / 3 kv heads at tp 2).

    With at least as many kv heads as ranks, each rank gets whole GQA groups; otherwise the q
    heads are split and each rank keeps (replicates) the kv heads its q heads read.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                         f"num_key_value_heads ({num_kv_heads})")
    if tp_size > num_heads:
        raise ValueError(f"tensor parallel size {tp_size} exceeds the {num_heads} attention heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv = even_split(num_kv_heads, tp_size, tp_rank)
        return HeadPartition(range(kv.start * group, kv.stop * group), tuple(range(kv.start, kv.stop)))
    q = even_split(num_heads, tp_size, tp_rank)
    q_heads = range(q.start, q.stop)
    used = sorted({h // group for h in q_heads})
    local_group = len(q_heads) // len(used)
    if len(q_heads) % len(used) == 0 and all(
            used[i // local_group] == h // group for i, h in enumerate(q_heads)):
        return HeadPartition(q_heads, tuple(used))
    return HeadPartition(q_heads, tuple(h // group for h in q_heads))   # one kv copy per q head


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


class PackableLinear(nn.Module):
    """A linear layer (`self.weight` [out, in], no bias) whose CPU weight can be prepacked.

    `prepack()` lays the weight out once after loading for the kernel that multiplies it, the one
    `kernels.paths.cpu_linear` chooses:
    - fp32 on CPUs without AVX-512 (where the native linear library loads): panels for
      kernels/native/linear_f32.c, at every batch size. On the AVX2 EPYC it
      beats both oneDNN's packed product and MKL's sgemm (2 threads, one SmolLM2 forward's
      matmuls: M=1 20.8 vs 33.2 ms, M=64 119.8 vs 149.2, M=1024 2,002 vs 2,338 for MKL; all
      figures in that file). On AVX-512 CPUs, where its 8-lane vectors were not measured against
      oneDNN, fp32 stays on the next rule. PAGEDSERVE_FP32_LINEAR=native|onednn overrides.
    - fp32 otherwise: oneDNN's packed product (it reorders a plain weight on every call
      otherwise; AVX2 EPYC, M=16 75.5 -> 45.1 ms, M=64 218 -> 151 ms against MKL's F.linear),
      up to FP32_PACKED_MAX_ROWS rows; from there on (prefill chunks) MKL's F.linear was faster.
    - bf16 where oneDNN has a bf16 inner product (`bf16_prepack_supported()`: AVX-512 BF16,
      AMX): oneDNN's packed product (1 thread: [64 x 576] @ [576 x 3072] 522 -> 341 us; same
      results bit for bit).
    - bf16 elsewhere (AVX2, where torch emulates the bf16 product at
      ~17 GFLOP/s): bf16 panels for kernels/native/linear_bf16.c, widened to fp32 in registers
      and summed in fp32. PAGEDSERVE_BF16_LINEAR=native|torch overrides.
    fp32 kernels sum in another order than F.linear (~1e-4 relative); the fp32 greedy-equality
    tests against transformers pass with them. PAGEDSERVE_PREPACK=0 turns every prepack off.
    """

    FP32_PACKED_MAX_ROWS = 512
    packed: torch.Tensor | None = None   # oneDNN's layout
    panels: torch.Tensor | None = None   # kernels/native_linear.py's layout (fp32 or bf16)
    q8: native_linear_q8.PackedQ8 | None = None   # --quantization int8
    quantized: QuantizedMatmul | None = None       # kept in the checkpoint's block format
    lora = None   # workers/lora/stack.LoRAStack: the adapters' products, added to every matmul

    @property
    def prepacked(self) -> bool:
        return self.packed is not None or self.panels is not None or self.q8 is not None \
            or self.quantized is not None

    def stage_quantized(self, offset: int, weight: QuantizedWeight) -> None:
        """Rows [offset, offset + rows) of the weight, kept quantized (see finish_loading)."""
        rows, cols = self.weight.shape
        if weight.k != cols or offset + weight.shape[0] > rows:
            raise ValueError(f"expected at most {rows - offset} rows of {cols} columns, got "
                             f"{tuple(weight.shape)}")
        self.__dict__.setdefault("_staged", []).append((offset, weight))

    def finish_loading(self) -> bool:
        """After the last tensor: run on the staged quantized parts if they make the whole
        weight (whose plain copy becomes a meta tensor), else dequantize them into it (a
        checkpoint that stores part of a fused projection unquantized). Whether it is quantized."""
        staged = self.__dict__.pop("_staged", None)
        if not staged:
            return False
        weight = self.weight
        if sum(part.shape[0] for _, part in staged) == weight.shape[0]:
            self.quantized = QuantizedMatmul(staged, weight.device)
            self.weight = _param(tuple(weight.shape), weight.dtype, "meta")
            return True
        with torch.no_grad():
            for offset, part in staged:
                weight[offset:offset + part.shape[0]].copy_(part.dequantize(weight.dtype))
        return False

    def quantize_int8(self) -> bool:
        """--quantization int8: quantize a CPU fp32 weight whose in_features are whole blocks of
        32 (kernels/native_linear_q8.py); whether it did. Other weights stay as they are."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 \
                or not native_linear_q8.supports(weight.shape[1]) or self.quantized is not None:
            return False
        self.q8 = native_linear_q8.pack(weight.detach())
        return True

    def prepack(self) -> bool:
        """Pack a CPU fp32 or (packable) bf16 weight for its kernel; whether it did."""
        weight = self.weight
        if weight.device.type != "cpu" or self.q8 is not None or self.quantized is not None:
            return False
        kernel = paths.cpu_linear(weight.dtype).kernel
        if kernel in (paths.LINEAR_F32, paths.LINEAR_BF16):
            self.panels = native_linear.pack(weight.detach())
        elif kernel == paths.ONEDNN:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        else:
            return False
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        if self.lora is not None:
            self.lora.add_to(x, out)
        return out

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        if self.q8 is not None and x.dim() == 2 and x.dtype == torch.float32:
            return native_linear_q8.linear(x, self.q8)
        if self.panels is not None and x.dim() == 2 and x.dtype == self.panels.dtype:
            return native_linear.linear(x, self.panels, self.weight.shape[0])
        if self.packed is not None and x.dim() == 2 and (
                x.shape[0] < self.FP32_PACKED_MAX_ROWS or x.dtype != torch.float32):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if self.weight.is_meta:
            raise ValueError(f"PackableLinear: a {x.dtype} input of shape {tuple(x.shape)} does "
                             f"not fit the packed weight, and its plain copy was released "
                             f"(release_packed_weights)")
        return F.linear(x, self.weight)


KEPT_QUANTIZED = ("gguf", "awq", "gptq")


def check_quantization(quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a --quantization this worker cannot run, at start rather than at the first step
    (`quantization` as resolved for the checkpoint: loader.weights_quantization)."""
    if quantization == "none":
        return
    if quantization not in QUANTIZATIONS or quantization == "auto":
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; "
                         f"got {quantization!r}")
    if quantization in KEPT_QUANTIZED:
        if device.type == "cpu" and dtype != torch.float32:
            raise ValueError(f"{quantization} weights kept quantized run on CPU workers in "
                             f"float32 activations; this worker has {dtype} (--dtype auto or "
                             f"float32, or --quantization none to dequantize them at load)")
        if device.type == "cpu" and not native_linear_gguf.available():
            raise ValueError(f"{quantization} weights kept quantized need the native CPU kernels: "
                             f"{native.unavailable_reason(native_linear_gguf.FEATURE)} "
                             f"(--quantization none dequantizes them at load)")
        return
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"--quantization int8 runs on CPU workers in float32; this worker has "
                         f"{dtype} on {device.type}")
    if not native_linear_q8.available():
        raise ValueError(f"--quantization int8 needs the native CPU kernels: "
                         f"{native.unavailable_reason(native_linear_q8.FEATURE)}")


def finish_loading(model: nn.Module) -> tuple[int, int]:
    """PackableLinear.finish_loading for every linear of `model`: (kept quantized, all). The
    heap is trimmed after each: a linear packs its raw GGUF parts into new panels and frees them,
    and free() would keep the freed pages while the next linears allocate fresh ones (Qwen
    0.5B Q4_K_M: a peak of ~1.5x the loaded footprint)."""
    linears = [module for module in model.modules() if isinstance(module, PackableLinear)]
    kept = 0
    for module in linears:
        if module.finish_loading():
            kept += 1
            trim_heap()
    return kept, len(linears)


def quantize_linears(model: nn.Module) -> tuple[int, int]:
    """--quantization int8 for every PackableLinear of `model` (after loading): (quantized, all)."""
    linears = [module for module in model.modules() if isinstance(module, PackableLinear)]
    return sum(module.quantize_int8() for module in linears), len(linears)


def prepack_linears(model: nn.Module) -> int:
    """Prepack every PackableLinear of `model` (after its weights are loaded); how many."""
    return sum(module.prepack() for module in model.modules()
               if isinstance(module, PackableLinear))


def release_packed_weights(model: nn.Module) -> int:
    """Free the plain weight of every PackableLinear whose packed form serves every input the
    model gives it (native fp32/bf16 panels, int8) and that no other module holds (a tied LM
    head's weight is the embedding table): otherwise each such weight sits in memory twice
    (SmolLM2-135M in fp32: 425 MB a worker). The weight becomes a meta tensor of the same shape
    and dtype, so shapes still read and any use of its values fails loudly. Bytes freed."""
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    freed = 0
    for module in model.modules():
        if not isinstance(module, PackableLinear) or (module.panels is None and module.q8 is None):
            continue
        weight = module.weight
        if weight.is_meta or holders[id(weight)] != 1:
            continue
        freed += weight.numel() * weight.element_size()
        module.weight = _param(tuple(weight.shape), weight.dtype, "meta")
    return freed


class QKVParallelLinear(PackableLinear):
    """Fused q/k/v projection for this rank's heads (column parallel): out = [q | k | v], with
    an optional bias cut like the weight. `head_perm` reorders the dims of every q and k head
    (the same order for both, so q.k is unchanged): GLM's interleaved RoPE pairs become the
    rotate-halves pairs every kernel here applies (rotary.interleaved_head_perm)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 part: HeadPartition, dtype: torch.dtype, device: torch.device | str,
                 bias: bool = False, head_perm: torch.Tensor | None = None) -> None:
        super().__init__()
        self.head_dim, self.hidden_size, self.head_perm = head_dim, hidden_size, head_perm
        self.total_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        self.heads = {"q": torch.tensor(list(part.q_heads)), "k": torch.tensor(part.kv_heads),
                      "v": torch.tensor(part.kv_heads)}
        nq, nkv = len(part.q_heads), len(part.kv_heads)
        self.sizes = (nq * head_dim, nkv * head_dim, nkv * head_dim)
        self.weight = _param((sum(self.sizes), hidden_size), dtype, device)
        self.bias = _param((sum(self.sizes),), dtype, device) if bias else None

    def load(self, shard: str, full: torch.Tensor, what: str = "weight") -> None:
        """This rank's heads of q_proj / k_proj / v_proj's `what` (weight [heads*D, hidden] or
        bias [heads*D])."""
        total, d = self.total_heads[shard], self.head_dim
        offset = {"q": 0, "k": self.sizes[0], "v": self.sizes[0] + self.sizes[1]}[shard]
        if isinstance(full, QuantizedWeight) and what == "weight":
            if full.shape != (total * d, self.hidden_size):
                raise ValueError(f"{shard}_proj.weight: expected shape {(total * d, self.hidden_size)}"
                                 f", got {full.shape}")
            dims = self.head_perm if self.head_perm is not None and shard != "v" else torch.arange(d)
            self.stage_quantized(offset, full.rows((self.heads[shard][:, None] * d + dims).reshape(-1)))
            return
        dst = self.weight if what == "weight" else self.bias
        if dst is None:
            raise ValueError(f"{shard}_proj.{what}: this model's projections have no {what}")
        tail = full.shape[1:]
        if full.shape[0] != total * d or tuple(tail) != tuple(dst.shape[1:]):
            raise ValueError(f"{shard}_proj.{what}: expected shape "
                             f"{(total * d, *dst.shape[1:])}, got {tuple(full.shape)}")
        heads = full.view(total, d, *tail)[self.heads[shard]]
        if self.head_perm is not None and shard != "v":
            heads = heads[:, self.head_perm]
        size = self.sizes["qkv".index(shard)]
        _copy_checked(dst[offset:offset + size], heads.reshape(-1, *tail),
                      f"{shard}_proj.{what} rank shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        return out if self.bias is None else out.add_(self.bias)


class MergedColumnParallelLinear(PackableLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate|up)."""

    def __init__(self, in_features: int, out_features: int, num_merged: int, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.rows = even_split(out_features, tp.size, tp.rank)
        self.shard_size = self.rows.stop - self.rows.start
        self.weight = _param((num_merged * self.shard_size, in_features), dtype, device)

    def load(self, index: int, full: torch.Tensor | QuantizedWeight) -> None:
        if isinstance(full, QuantizedWeight):
            self.stage_quantized(index * self.shard_size, full.rows(self.rows))
            return
        dst = self.weight[index * self.shard_size:(index + 1) * self.shard_size]
        _copy_checked(dst, full[self.rows], f"merged column shard {index}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class RowParallelLinear(PackableLinear):
    """Consumes this rank's slice `cols` of the input features; partial sums are all-reduced."""

    def __init__(self, cols: slice, out_features: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str, bias: bool = False) -> None:
        super().__init__()
        self.cols, self.tp = cols, tp
        self.weight = _param((out_features, cols.stop - cols.start), dtype, device)
        # every rank holds the whole bias and adds it after the all-reduce
        self.bias = _param((out_features,), dtype, device) if bias else None

    def load(self, full: torch.Tensor | QuantizedWeight, what: str = "weight") -> None:
        if isinstance(full, QuantizedWeight) and what == "weight":
            if full.shape[0] != self.weight.shape[0]:
                raise ValueError(f"row parallel weight: expected {self.weight.shape[0]} rows, "
                                 f"got shape {full.shape}")
            try:
                part = full if full.k == self.weight.shape[1] else full.cols(self.cols)
            except ValueError:   # this rank's columns cut blocks: its slice dequantized
                part = None
            if part is not None:
                self.stage_quantized(0, part)
                return
            full = full.dequantize(self.weight.dtype)
        if what == "bias" and self.bias is not None:
            _copy_checked(self.bias, full, "row parallel bias")
        elif what == "bias":
            raise ValueError("this model's output projection has no bias")
        elif full.dim() != 2 or full.shape[0] != self.weight.shape[0]:
            raise ValueError(f"row parallel weight: expected {self.weight.shape[0]} rows, got "
                             f"shape {tuple(full.shape)}")
        else:
            _copy_checked(self.weight, full[:, self.cols], "row parallel shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.matmul(x))
        return out if self.bias is None else out.add_(self.bias)


def _native_rows(*tensors: torch.Tensor) -> bool:
    return native_cpu_elementwise() and native_elementwise.supports(*tensors)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((hidden_size,), dtype, device)

    def load(self, full: torch.Tensor) -> None:
        _copy_checked(self.weight, full, "norm weight")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x) * weight; with `residual`, first residual += x in place and return
        (rmsnorm(residual) * weight, residual), vLLM's fused add + norm."""
        native = self.weight.dtype == x.dtype and _native_rows(
            *((x,) if residual is None else (x, residual)))
        if residual is None:
            if native:
                return native_elementwise.rms_norm(x, self.weight, self.eps)
            # fp32 statistics like the reference model; the fused op keeps bf16 in and out.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if native:
            return native_elementwise.fused_add_rms_norm(x, residual, self.weight,
                                                         self.eps), residual
        residual.add_(x)
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last axis."""
    if _native_rows(gate_up):
        return native_elementwise.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up = [gate | up] (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)
