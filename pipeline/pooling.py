"""Embeddings: how a model pools its hidden states into one vector (`PoolerConfig`, per model)
and what one embedding request asks for (`PoolingParams`, per request, on the wire).

A pooling request is prefill-only: the scheduler computes its prompt and finishes it on the
step that completes it, the worker returning the pooled vector instead of a sampled token.
`LAST` pools the last prompt token's final hidden state (any decoder; the prompt may be
computed in chunks and read the prefix cache, its KV being what a generation computes);
`MEAN` and `CLS` need every prompt token's hidden state in one step, so such a prompt is never
split and never starts from cached blocks (vLLM does the same). Vectors travel as little-endian
float32 bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

POOLING_TYPES = ("LAST", "MEAN", "CLS")
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per /v1/embeddings request


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An embedding request (its presence on AddRequest makes the request prefill-only).
    `dimensions`: keep the first this many components and normalize again (Matryoshka
    truncation, OpenAI's `dimensions`); None: all of them."""

    dimensions: int | None = None

    def validate(self, hidden_size: int) -> "PoolingParams":
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool)
                              or not 1 <= d <= hidden_size):
            raise ValueError(f"dimensions must be an integer from 1 to the model's hidden size "
                             f"{hidden_size}, got {d!r}")
        return self


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """--pooler-config (vLLM's JSON: {"pooling_type": "MEAN", "normalize": true}), or the
    model's sentence-transformers files, or the default for its kind."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    @property
    def whole_prompt(self) -> bool:
        """Every prompt token's hidden state is read: one chunk, no cached prefix."""
        return self.pooling_type != "LAST"

    def to_dict(self) -> dict:
        return {"pooling_type": self.pooling_type, "normalize": self.normalize}

    @classmethod
    def parse(cls, text: str | dict | None, base: "PoolerConfig") -> "PoolerConfig":
        """`base` with the fields the JSON object `text` sets (None: `base`)."""
        if text is None:
            return base
        fields = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(fields, dict):
            raise ValueError(f"--pooler-config must be a JSON object, got {text!r}")
        unknown = sorted(set(fields) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"--pooler-config: unknown field(s) {unknown} (known: pooling_type, "
                             "normalize)")
        kind = fields.get("pooling_type", base.pooling_type)
        return cls(kind.upper() if isinstance(kind, str) else kind,
                   fields.get("normalize", base.normalize))

    @classmethod
    def for_model(cls, model_dir: str | Path, encoder: bool) -> "PoolerConfig":
        """From the model's sentence-transformers modules (1_Pooling/config.json, a Normalize
        module) when it has them; else LAST for a decoder, CLS for an encoder, normalized."""
        root = Path(model_dir)
        default = cls("CLS" if encoder else "LAST", True)
        try:
            modules = json.loads((root / "modules.json").read_text())
        except (OSError, ValueError):
            return default
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules
                 if isinstance(m, dict)}
        normalize = "Normalize" in kinds
        if "Pooling" not in kinds:
            return cls(default.pooling_type, normalize)
        try:
            pooling = json.loads((root / kinds["Pooling"] / "config.json").read_text())
        except (OSError, ValueError):
            return cls(default.pooling_type, normalize)
        for key, kind in (("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"),
                          ("pooling_mode_lasttoken", "LAST")):
            if pooling.get(key):
                return cls(kind, normalize)
        raise ValueError(f"{root / kinds['Pooling']}/config.json: no pooling mode we support "
                         f"(mean, cls, lasttoken): {pooling}")


def to_bytes(vector: np.ndarray) -> bytes:
    """A vector as it travels: little-endian float32."""
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()


def from_bytes(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f4")


def truncate(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` components, normalized again (unit length stays unit length)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = np.asarray(vector[:dimensions], dtype=np.float32)
    norm = float(np.linalg.norm(head))
    return head / norm if norm > 0 else head
