"""A GGUF with random weights in a llama model's shapes, for benchmarks of large models whose
real weights are not here (Llama-2-7B: 3.6-3.9 GiB of 4-bit blocks).

The file is what llama.cpp's convert_hf_to_gguf.py + llama-quantize write for a llama model:
general.architecture "llama", the llama.* hyperparameters, the tensor names token_embd /
blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,ffn_up,ffn_down} /
output_norm / output, norms in F32 and the matrices in the --type's mix (as llama-quantize
chooses them):

    Q4_0    every matrix Q4_0 but output.weight Q6_K                       (file type 2)
    Q4_K    every matrix Q4_K but output.weight Q6_K                       (file type 14)
    Q4_K_M  Q4_K, with output.weight and half the layers' attn_v and ffn_down Q6_K
            (llama.cpp's use_more_bits: the first and last eighth, then every third)   (15)

plus a made-up sentencepiece ("llama") vocabulary of the preset's size: <unk> <s> </s>, the 256
byte tokens <0x00>..<0xFF>, then printable characters and letter strings with and without the
"▁" word prefix, with scores and token types, so that llama.cpp's llama-server and
transformers' GGUF reader both accept the file.

Weights are random normal x 0.02 (norms 1 + normal x 0.02), drawn and quantized tensor by
tensor in slices of rows, and written with GGUFWriter's streaming calls (tensor infos first,
then each tensor's bytes as it is made), so no tensor exists in fp32 as a whole and the 7B never
sits in memory: the peak RSS is that of the largest quantized tensor plus a slice (~0.3 GiB).
gguf-py quantizes Q4_0 (gguf.quants.quantize); it has no Q4_K or Q6_K quantizer, so those are
here (min/max scales, not llama.cpp's search: the blocks are valid, their error is not
minimal, which random weights do not need), and their round trip is checked against gguf-py's
dequantizer on the first slice of each tensor.

    .venv/bin/python scripts/write_random_gguf.py --preset tiny --out /tmp/tiny.gguf
    .venv/bin/python scripts/write_random_gguf.py --preset llama2-7b   # into the cache

The default output is $PAGEDSERVE_CACHE/random-gguf/<preset>-random-<type>.gguf (never inside
the repository); the file is written beside it and renamed into place when complete, so an
existing file is always whole (`--reuse` keeps it).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

PRESETS_DOC = "llama2-7b: Llama-2-7B's shapes; tiny: 2 layers of 256 for testing this script"


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    ctx: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {p.name: p for p in (
    Preset("llama2-7b", hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008,
           vocab=32000, rope_theta=10000.0, rms_eps=1e-5, ctx=4096),
    # 256 wide (one Q4_K super-block), GQA 4:2, the same vocabulary as the 7B
    Preset("tiny", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512,
           vocab=32000, rope_theta=10000.0, rms_eps=1e-5, ctx=2048),
)}

TYPES = ("Q4_0", "Q4_K", "Q4_K_M")
FILE_TYPE = {"Q4_0": 2, "Q4_K": 14, "Q4_K_M": 15}  # llama_ftype: MOSTLY_Q4_0, _Q4_K_S, _Q4_K_M
WEIGHT_SCALE = 0.02
SLICE_ELEMENTS = 1 << 23  # rows drawn and quantized at a time: ~32 MiB of fp32


def log(message: str) -> None:
    print(f"[random-gguf] {message}", file=sys.stderr, flush=True)


def default_path(preset: str, qtype: str) -> Path:
    from pagedserve import envs
    return envs.current().cache_root / "random-gguf" / f"{preset}-random-{qtype}.gguf"


# ------------------------------------------------------------------------------ quantizers

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks of 256 (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 of
    nibbles): x ~ d*sc[j]*q - dmin*m[j] over 8 sub-blocks of 32."""
    import gguf
    x = rows.reshape(-1, 8, 32).astype(np.float32, copy=False)
    n = x.shape[0]
    lo = np.minimum(x.min(axis=-1), 0.0)                     # (n, 8), <= 0
    hi = x.max(axis=-1)
    scale = np.maximum(hi - lo, 0.0) / 15.0                  # per sub-block
    minv = -lo                                               # >= 0
    d = _f16(scale.max(axis=-1) / 63.0)                      # (n,)
    dmin = _f16(minv.max(axis=-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.rint(minv / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]                          # (n, 8, 1)
        offset = (dminf * m)[..., None]
        q = np.where(step > 0, np.rint((x + offset) / step), 0).clip(0, 15).astype(np.uint8)
    # nibbles: byte b of 32-byte group g holds sub-block 2g (low) and 2g+1 (high), element b
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << np.uint8(4))).reshape(n, 128)
    # scales: bytes 0-3 sc[0:4] | sc[4:8]>>4 << 6; 4-7 the same for m; 8-11 the low nibbles
    packed = np.empty((n, 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << np.uint8(6))
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << np.uint8(6))
    packed[:, 8:12] = (sc[:, 4:8] & np.uint8(0x0F)) | ((m[:, 4:8] & np.uint8(0x0F)) << np.uint8(4))
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                             packed, qs], axis=-1)
    assert blocks.shape[1] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K][1]
    return blocks


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K blocks of 256 (210 bytes: 128 of low nibbles, 64 of high 2-bit pairs, 16 int8
    scales, d): x ~ d*sc[j]*(q-32) over 16 sub-blocks of 16."""
    x = rows.reshape(-1, 16, 16).astype(np.float32, copy=False)
    n = x.shape[0]
    sub = np.abs(x).max(axis=-1) / 31.0                      # (n, 16)
    d = _f16(sub.max(axis=-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(sub / df), 0).clip(0, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = (np.where(step > 0, np.rint(x / step), 0).clip(-32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 256)
    low, high = q & np.uint8(0x0F), q >> np.uint8(4)
    # element e = h*128 + s*64 + b: ql[h*64 + b], nibble s; e = h*128 + k*32 + b: qh[h*32 + b]
    low = low.reshape(n, 2, 2, 64)
    ql = (low[:, :, 0, :] | (low[:, :, 1, :] << np.uint8(4))).reshape(n, 128)
    high = high.reshape(n, 2, 4, 32)
    qh = (high[:, :, 0, :] | (high[:, :, 1, :] << np.uint8(2)) | (high[:, :, 2, :] << np.uint8(4))
          | (high[:, :, 3, :] << np.uint8(6))).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=-1)


def quantize(rows: np.ndarray, qtype) -> np.ndarray:
    """rows (r, k) fp32 -> (r, k / block * type_size) uint8 blocks of `qtype`."""
    import gguf
    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return rows.astype(np.float32, copy=False)
    if qtype in (Q.Q4_K, Q.Q6_K):
        fn = quantize_q4_k if qtype == Q.Q4_K else quantize_q6_k
        blocks = fn(rows)
        return blocks.reshape(rows.shape[0], -1)
    return gguf.quants.quantize(rows, qtype)


# ------------------------------------------------------------------------------ the model

@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]   # numpy order: (out, in) for a matrix
    qtype: str               # a GGMLQuantizationType name
    norm: bool = False


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get Q6_K in a Q4_K_M file."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_specs(p: Preset, qtype: str) -> list[TensorSpec]:
    base = "Q4_0" if qtype == "Q4_0" else "Q4_K"

    def more(i: int) -> str:
        return "Q6_K" if qtype == "Q4_K_M" and use_more_bits(i, p.layers) else base
    kv = p.kv_heads * p.head_dim
    specs = [TensorSpec("token_embd.weight", (p.vocab, p.hidden), base)]
    for i in range(p.layers):
        b = f"blk.{i}."
        specs += [TensorSpec(b + "attn_norm.weight", (p.hidden,), "F32", norm=True),
                  TensorSpec(b + "attn_q.weight", (p.hidden, p.hidden), base),
                  TensorSpec(b + "attn_k.weight", (kv, p.hidden), base),
                  TensorSpec(b + "attn_v.weight", (kv, p.hidden), more(i)),
                  TensorSpec(b + "attn_output.weight", (p.hidden, p.hidden), base),
                  TensorSpec(b + "ffn_norm.weight", (p.hidden,), "F32", norm=True),
                  TensorSpec(b + "ffn_gate.weight", (p.intermediate, p.hidden), base),
                  TensorSpec(b + "ffn_up.weight", (p.intermediate, p.hidden), base),
                  TensorSpec(b + "ffn_down.weight", (p.hidden, p.intermediate), more(i))]
    specs += [TensorSpec("output_norm.weight", (p.hidden,), "F32", norm=True),
              TensorSpec("output.weight", (p.vocab, p.hidden), "Q6_K")]
    return specs


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """A made-up sentencepiece vocabulary: pieces, scores, token types (gguf.TokenType)."""
    import gguf
    T = gguf.TokenType
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    scores = [0.0] * len(pieces)
    seen = set(pieces)

    def normal(piece: str) -> None:
        if len(pieces) < size and piece not in seen:
            seen.add(piece)
            pieces.append(piece)
            types.append(T.NORMAL)
            scores.append(-float(len(scores)))  # earlier pieces merge first
    chars = [chr(c) for c in range(33, 127)]
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    normal("▁")
    for c in chars:
        normal("▁" + c)
        normal(c)
    length = 2
    while len(pieces) < size:  # letter strings, most frequent letters first
        for idx in np.ndindex(*([len(letters)] * length)):
            word = "".join(letters[i] for i in idx)
            normal("▁" + word)
            normal(word)
            if len(pieces) >= size:
                break
        length += 1
    return pieces, scores, [int(t) for t in types]


def write_random_gguf(path: Path, preset: Preset, qtype: str = "Q4_0", seed: int = 0) -> dict:
    """Write the file (into path.partial, then renamed); what was written."""
    import gguf
    Q = gguf.GGMLQuantizationType
    start = time.monotonic()
    specs = tensor_specs(preset, qtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_type("model")
    writer.add_name(f"random {preset.name} {qtype}")
    writer.add_description(f"random weights (normal x {WEIGHT_SCALE}, seed {seed}) in "
                           f"{preset.name}'s shapes, written by pagedserve's "
                           "scripts/write_random_gguf.py")
    writer.add_vocab_size(preset.vocab)
    writer.add_context_length(preset.ctx)
    writer.add_embedding_length(preset.hidden)
    writer.add_block_count(preset.layers)
    writer.add_feed_forward_length(preset.intermediate)
    writer.add_rope_dimension_count(preset.head_dim)
    writer.add_head_count(preset.heads)
    writer.add_head_count_kv(preset.kv_heads)
    writer.add_layer_norm_rms_eps(preset.rms_eps)
    writer.add_rope_freq_base(preset.rope_theta)
    writer.add_file_type(FILE_TYPE[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    pieces, scores, types = vocabulary(preset.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    def nbytes(spec: TensorSpec) -> tuple[tuple[int, ...], int]:
        if spec.qtype == "F32":
            return spec.shape, int(np.prod(spec.shape)) * 4
        shape = gguf.quant_shape_to_byte_shape(spec.shape, Q[spec.qtype])
        return shape, int(np.prod(shape))
    for spec in specs:
        shape, size = nbytes(spec)
        if spec.qtype == "F32":
            writer.add_tensor_info(spec.name, shape, np.dtype(np.float32), size)
        else:
            writer.add_tensor_info(spec.name, shape, np.dtype(np.uint8), size,
                                   raw_dtype=Q[spec.qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = 0
    try:
        for index, spec in enumerate(specs):
            rng = np.random.default_rng([seed, index])
            if spec.norm:
                data = 1.0 + WEIGHT_SCALE * rng.standard_normal(spec.shape, dtype=np.float32)
            else:
                data = make_quantized(spec, Q[spec.qtype], rng, check=True)
            writer.write_tensor_data(data)
            total += data.nbytes
            if index % 9 == 0 or index == len(specs) - 1:
                log(f"{index + 1}/{len(specs)} tensors, {total / 2**30:.2f} GiB, "
                    f"{time.monotonic() - start:.0f} s, peak RSS {peak_rss_gib():.2f} GiB")
        writer.close()
        os.replace(partial, path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    counts: dict[str, int] = {}
    for spec in specs:
        counts[spec.qtype] = counts.get(spec.qtype, 0) + 1
    return {"path": str(path), "preset": asdict(preset), "type": qtype, "seed": seed,
            "bytes": path.stat().st_size, "tensors": len(specs), "tensor_types": counts,
            "seconds": round(time.monotonic() - start, 1),
            "peak_rss_gib": round(peak_rss_gib(), 3)}


def make_quantized(spec: TensorSpec, qtype, rng: np.random.Generator, check: bool) -> np.ndarray:
    """The tensor's quantized bytes, drawn and quantized a slice of rows at a time."""
    import gguf
    rows, cols = spec.shape
    out = np.empty(gguf.quant_shape_to_byte_shape(spec.shape, qtype), np.uint8)
    step = max(1, SLICE_ELEMENTS // cols)
    for r in range(0, rows, step):
        x = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        x *= WEIGHT_SCALE
        q = quantize(x, qtype)
        if check and r == 0:
            check_round_trip(x, q, qtype, spec.name)
        out[r:r + len(x)] = q
        del x, q
    return out


def check_round_trip(x: np.ndarray, q: np.ndarray, qtype, name: str) -> None:
    """gguf-py's dequantizer gets back x within the format's step (the blocks are valid)."""
    import gguf
    back = gguf.quants.dequantize(q[:64], qtype)
    ref = x[:64]
    err = np.abs(back - ref).max()
    tol = {"Q4_0": 0.25, "Q4_K": 0.2, "Q6_K": 0.05}[qtype.name] * np.abs(ref).max()
    if back.shape != ref.shape or not err <= tol:
        raise AssertionError(f"{name}: {qtype.name} round trip error {err} > {tol}")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def ensure(preset: str = "llama2-7b", qtype: str = "Q4_0", path: Path | None = None,
           seed: int = 0) -> Path:
    """The random file at `path` (default: in the cache), written first if it is not there."""
    path = Path(path) if path else default_path(preset, qtype)
    if not path.is_file():
        log(f"writing {path}")
        log(json.dumps(write_random_gguf(path, PRESETS[preset], qtype, seed)))
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama2-7b", help=PRESETS_DOC)
    ap.add_argument("--type", dest="qtype", choices=TYPES, default="Q4_0")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: $PAGEDSERVE_CACHE/random-gguf/<preset>-random-<type>.gguf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="keep an existing file")
    args = ap.parse_args(argv)
    path = args.out or default_path(args.preset, args.qtype)
    if args.reuse and path.is_file():
        result = {"path": str(path), "reused": True, "bytes": path.stat().st_size}
    else:
        result = write_random_gguf(path, PRESETS[args.preset], args.qtype, args.seed)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
