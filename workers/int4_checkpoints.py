"""AWQ and GPTQ int4 safetensors checkpoints, read into our in-memory int4 format (I4G).

`detect_quantization(config)` tells from config.json's `quantization_config` whether a model is
an int4 checkpoint we read ("awq" or "gptq") and refuses the variants we don't;
`iter_int4_weights(model_dir, config)` yields every tensor as `iter_weights` does, except that
each quantized linear `X` (`X.qweight`, `X.qzeros`, `X.scales`, GPTQ's `X.g_idx`) comes out once,
as `("X.weight", QuantizedWeight(QType.I4G, ...))`, repacked one linear at a time.

Layouts read (int32 words, little-endian nibbles; w[n_, k_] = (q - z) * s):
- AWQ GEMM (AutoAWQ's WQLinear_GEMM): qweight [k, n/8] packs 8 codes along n in the order
  [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [k/g, n/8] the same way; scales [k/g, n].
- GPTQ (AutoGPTQ / GPTQModel): qweight [k/8, n] packs 8 codes along k in order; qzeros
  [k/g, n/8] along n in order; scales [k/g, n]; g_idx [k] the group of each input column.
  Format "gptq" (v1) stores each zero minus one, subtracted from the whole word (GPTQModel's
  v2 -> v1 export: a zero of 0 borrows from the next nibble), so the zeros are read back as
  GPTQModel reads them: word + 0x11111111, then the nibbles. "gptq_v2" stores them as they are.
  An unsorted g_idx (desc_act) becomes `perm` = argsort(g_idx), the columns stored in that order.

Group sizes 32, 64 and 128 (and -1, one group per output row) become blocks of 32 that repeat
their group's scale: d = scale, m = -scale * zero, both fp32 and exact for fp16 scales.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from pagedserve.kernels.quant_formats import QType, QuantizedWeight
from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers.checkpoint_files import weight_files

GROUP_SIZES = (32, 64, 128, -1)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)           # packed position i holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)   # column j sits at packed position REVERSE[j]
QUANT_PARTS = ("qweight", "qzeros", "scales", "g_idx")
BLOCK = 32
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Int4Scheme:
    """How one checkpoint packs its int4 linears (from its quantization_config)."""
    method: str        # "awq" | "gptq"
    group_size: int    # 32, 64, 128, or -1: one group spanning all k columns
    zero_offset: int   # added to each packed zero word's nibbles: 1 for GPTQ v1, else 0


def detect_quantization(config: dict) -> str | None:
    """"awq" or "gptq" for an int4 checkpoint we read, None without quantization_config;
    ModelLoadError naming the field for any other method, bit width, group size or layout."""
    scheme = int4_scheme(config)
    return scheme.method if scheme is not None else None


def int4_scheme(config: dict) -> Int4Scheme | None:
    """config.json (a dict) -> the packing of its int4 linears; None when not quantized."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError("config.json: quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ModelLoadError(f"config.json: quantization_config.quant_method {method!r} is not "
                             "supported (int4 AWQ or GPTQ checkpoints only)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"config.json: {method.upper()} checkpoint with bits={bits!r}; "
                             "only 4-bit AWQ/GPTQ is supported")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise ModelLoadError(f"config.json: {method.upper()} group_size={group_size!r} is not "
                             f"supported (32, 64, 128, or -1 for per-channel)")
    if method == "awq":
        _check_awq(qc)
        return Int4Scheme("awq", group_size, 0)
    return Int4Scheme("gptq", group_size, _gptq_zero_offset(qc))


def _check_awq(qc: dict) -> None:
    # transformers reads "version" (AutoAWQ's name) before "format", and maps backend "llm-awq"
    # to llm-awq's own interleaved packing
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if version != "gemm":
        raise ModelLoadError(f"config.json: AWQ version {version!r} is not supported: only "
                             "AutoAWQ's GEMM packing (\"version\": \"gemm\") is read; GEMV and "
                             "GEMV-fast pack along k and need re-quantizing as GEMM")
    if str(qc.get("backend", "")).lower() == "llm-awq":
        raise ModelLoadError("config.json: AWQ backend 'llm-awq' packs weights in llm-awq's own "
                             "interleaved layout; only AutoAWQ's GEMM layout is supported")
    if qc.get("zero_point", True) is not True:
        raise ModelLoadError("config.json: AWQ zero_point=false has no GEMM layout; only "
                             "zero-point AWQ (the AutoAWQ default) is supported")


def _gptq_zero_offset(qc: dict) -> int:
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"config.json: GPTQ checkpoint_format {fmt!r} is not supported "
                             "(only 'gptq' (v1) and 'gptq_v2')")
    pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise ModelLoadError(f"config.json: GPTQ pack_dtype {pack_dtype!r} is not supported "
                             "(only int32 words)")
    if qc.get("dynamic"):
        raise ModelLoadError("config.json: GPTQ 'dynamic' per-module bits/group sizes are not "
                             "supported")
    return 1 if fmt == "gptq" else 0


# ---------------------------------------------------------------- reading

def iter_int4_weights(model_dir: str | Path, config: dict
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, tensor as stored) for every tensor, except each quantized linear X:
    ("X.weight", I4G QuantizedWeight [n, k]), at the place of its first part. Reads one tensor
    at a time; ModelLoadError naming the tensor on missing parts or inconsistent shapes."""
    model_dir = Path(model_dir)
    scheme = int4_scheme(config)
    if scheme is None:
        raise ModelLoadError(f"{model_dir}: config.json has no quantization_config; not an "
                             "AWQ/GPTQ checkpoint")
    if sys.byteorder != "little":  # the repacking views int32 words as their bytes
        raise ModelLoadError("AWQ/GPTQ checkpoints are read on little-endian hosts only")
    with contextlib.ExitStack() as stack:
        reader = _Reader(model_dir, stack)
        quantized = {name[:-len(".qweight")] for name in reader.where
                     if name.endswith(".qweight")}
        done: set[str] = set()
        for name in reader.names():
            prefix, _, part = name.rpartition(".")
            if part not in QUANT_PARTS:
                if part == "weight" and prefix in quantized:
                    raise ModelLoadError(f"{model_dir}: both {name} and {prefix}.qweight in "
                                         "the checkpoint")
                yield name, reader.get(name)
            elif prefix not in quantized:
                raise ModelLoadError(f"{model_dir}: {name} has no {prefix}.qweight beside it")
            elif prefix not in done:
                done.add(prefix)
                yield f"{prefix}.weight", _read_linear(reader, prefix, scheme)


class _Reader:
    """Every weight file open at once (headers only; tensors read on demand by name), since one
    linear's parts may lie in different shards."""

    def __init__(self, model_dir: Path, stack: contextlib.ExitStack):
        from safetensors import SafetensorError, safe_open
        self.model_dir = model_dir
        self.files: dict[Path, object] = {}
        self.where: dict[str, Path] = {}
        for path in weight_files(model_dir):
            try:
                handle = stack.enter_context(safe_open(path, framework="pt"))
                self.files[path] = handle
                self.where.update((name, path) for name in handle.keys())  # noqa: SIM118
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from e

    def names(self) -> Iterator[str]:
        for handle in self.files.values():
            yield from handle.keys()

    def get(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError
        path = self.where[name]
        try:
            return self.files[path].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: cannot read {name} ({e})") from e

    def part(self, prefix: str, part: str, required: bool = True) -> torch.Tensor | None:
        name = f"{prefix}.{part}"
        if name in self.where:
            return self.get(name)
        if required:
            raise ModelLoadError(f"{self.model_dir}: {prefix}.qweight has no {name} in the "
                                 "checkpoint")
        return None


def _read_linear(reader: _Reader, prefix: str, scheme: Int4Scheme) -> QuantizedWeight:
    qweight = reader.part(prefix, "qweight")
    qzeros = reader.part(prefix, "qzeros")
    scales = reader.part(prefix, "scales")
    g_idx = reader.part(prefix, "g_idx", required=False)
    try:
        return repack_int4(scheme, qweight, qzeros, scales, g_idx)
    except _BadTensor as e:
        raise ModelLoadError(f"{reader.model_dir}: {prefix}.{e.part}: {e.problem}") from None


class _BadTensor(Exception):
    def __init__(self, part: str, problem: str):
        super().__init__(f"{part}: {problem}")
        self.part, self.problem = part, problem


def repack_int4(scheme: Int4Scheme, qweight: torch.Tensor, qzeros: torch.Tensor,
                scales: torch.Tensor, g_idx: torch.Tensor | None = None) -> QuantizedWeight:
    """One linear's packed tensors -> an I4G QuantizedWeight [n, k] (see the module docstring);
    _BadTensor naming the part on wrong dtypes or shapes."""
    _check_dtypes(qweight, qzeros, scales, g_idx)
    if scheme.method == "awq":
        k, n = qweight.shape[0], qweight.shape[1] * 8
    else:
        k, n = qweight.shape[0] * 8, qweight.shape[1]
    group_size = k if scheme.group_size == -1 else scheme.group_size
    if k == 0 or n == 0 or k % group_size or k % BLOCK:
        raise _BadTensor("qweight", f"shape {tuple(qweight.shape)} holds k = {k} input columns, "
                                    f"not a positive multiple of the group size {group_size} "
                                    f"(and of {BLOCK})")
    groups = k // group_size
    if tuple(scales.shape) != (groups, n):
        raise _BadTensor("scales", f"shape {tuple(scales.shape)} does not agree with qweight "
                                   f"(k = {k}, n = {n}) and group size {group_size}: expected "
                                   f"{(groups, n)}")
    if n % 8 or tuple(qzeros.shape) != (groups, n // 8):
        raise _BadTensor("qzeros", f"shape {tuple(qzeros.shape)} does not agree with qweight "
                                   f"(k = {k}, n = {n}) and group size {group_size}: expected "
                                   f"{(groups, n // 8)}")
    if scheme.method == "awq":
        if g_idx is not None:
            raise _BadTensor("g_idx", "AWQ checkpoints have no g_idx")
        codes = _nibbles(qweight).view(k, n // 8, 8)[..., AWQ_REVERSE_ORDER].reshape(k, n).t()
        zeros = _zero_nibbles(qzeros, 0).view(groups, n // 8, 8)[..., AWQ_REVERSE_ORDER]
        column_groups = torch.arange(k) // group_size
    else:
        # qweight [k/8, n]: word (r, c) holds columns 8r..8r+7 of row c, two per byte
        codes = _nibbles(qweight).view(k // 8, n, 8).permute(1, 0, 2).reshape(n, k)
        zeros = _zero_nibbles(qzeros, scheme.zero_offset)
        column_groups = _column_groups(g_idx, k, groups, group_size)
    perm = torch.argsort(column_groups, stable=True)
    if torch.equal(perm, torch.arange(k)):
        perm = None
    else:
        codes, column_groups = codes[:, perm], column_groups[perm]
    blocks = column_groups.view(k // BLOCK, BLOCK)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        raise _BadTensor("g_idx", f"its groups are not whole blocks of {BLOCK} columns")
    return _i4g(codes, zeros.reshape(groups, n), scales, blocks[:, 0], perm)


def _check_dtypes(qweight, qzeros, scales, g_idx) -> None:
    for part, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor.dtype != torch.int32 or tensor.dim() != 2:
            raise _BadTensor(part, f"expected a 2-D int32 tensor, got {tensor.dtype} "
                                   f"{tuple(tensor.shape)}")
    if scales.dtype not in _SCALE_DTYPES or scales.dim() != 2:
        raise _BadTensor("scales", f"expected a 2-D float16/bfloat16/float32 tensor, got "
                                   f"{scales.dtype} {tuple(scales.shape)}")
    if g_idx is not None and (g_idx.dtype not in (torch.int32, torch.int64) or g_idx.dim() != 1):
        raise _BadTensor("g_idx", f"expected a 1-D int32 tensor, got {g_idx.dtype} "
                                  f"{tuple(g_idx.shape)}")


def _column_groups(g_idx: torch.Tensor | None, k: int, groups: int,
                   group_size: int) -> torch.Tensor:
    """The group of each input column: g_idx, checked, or k // group_size without one."""
    if g_idx is None:
        return torch.arange(k) // group_size
    if g_idx.shape[0] != k:
        raise _BadTensor("g_idx", f"has {g_idx.shape[0]} entries but qweight has k = {k} "
                                  "input columns")
    g_idx = g_idx.long()
    if bool((g_idx < 0).any()) or bool((g_idx >= groups).any()):
        bad = g_idx[(g_idx < 0) | (g_idx >= groups)][0].item()
        raise _BadTensor("g_idx", f"group {bad} is out of range [0, {groups}) (scales has "
                                  f"{groups} groups)")
    return g_idx


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., w] -> uint8 [..., 8w]: each word's 8 nibbles, lowest first."""
    data = words.contiguous().view(torch.uint8)   # 4 little-endian bytes per word
    return torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)


def _zero_nibbles(qzeros: torch.Tensor, offset: int) -> torch.Tensor:
    """int32 [g, w] zero words -> uint8 [g, 8w]; `offset` added to every nibble of the word
    at once, carries included (how GPTQModel turns v1's stored zero - 1 back into the zero)."""
    if offset:
        words = (qzeros.long() + 0x11111111 * offset) & 0xFFFFFFFF
        qzeros = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return _nibbles(qzeros)


def _i4g(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
         block_groups: torch.Tensor, perm: torch.Tensor | None) -> QuantizedWeight:
    """codes uint8 [n, k] (stored column order), zeros uint8 [G, n], scales [G, n], the group of
    each block of 32 stored columns -> I4G rows: per block d, m (fp32), 16 bytes of nibbles."""
    n, k = codes.shape
    scale = scales.float()[block_groups]                        # [k/32, n]
    d = scale.t().contiguous()
    m = (-(scale * zeros.float()[block_groups])).t().contiguous()
    q = codes.reshape(n, k // BLOCK, BLOCK)
    packed = q[..., :16] | (q[..., 16:] << 4)                   # element j + 16: high nibble
    data = torch.cat([d.view(torch.uint8).view(n, -1, 4), m.view(torch.uint8).view(n, -1, 4),
                      packed], dim=-1).reshape(n, -1)
    return QuantizedWeight(QType.I4G, data, k, perm)
