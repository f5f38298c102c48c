"""RoPE: frequencies with the config's scaling, per-position cos/sin tables, the rotation.

Every kernel here rotates halves (pair (i, i + D/2) of a head turns by frequency i). Other
layouts are mapped onto that one when the weights load: `head_perm` reorders the dims of each
q and k head (the same for both, so attention scores are unchanged) so that GLM's interleaved
pairs (2i, 2i + 1), or a partial rotation of the first `rotary_dim` dims, become halves pairs;
dims that do not rotate get frequency 0 (cos 1, sin 0), which leaves them exactly as they are.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for RoPE with the config's scaling ('default', 'linear', 'llama3')."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported "
                     "(supported: default, linear, llama3)")


def head_perm(head_dim: int, rotary_dim: int, interleaved: bool) -> torch.Tensor | None:
    """The order of a q/k head's checkpoint dims that puts each rotating pair at (i, i + D/2)
    and the dims that do not rotate in the remaining places; None when it is the identity."""
    if rotary_dim == head_dim and not interleaved:
        return None
    half_rot, half = rotary_dim // 2, head_dim // 2
    pairs = torch.arange(half_rot)
    first, second = (2 * pairs, 2 * pairs + 1) if interleaved else (pairs, pairs + half_rot)
    rest = torch.arange(rotary_dim, head_dim)
    fill = half - half_rot
    return torch.cat((first, rest[:fill], second, rest[fill:]))


class RotaryEmbedding(nn.Module):
    """Rotate-halves RoPE over a precomputed cos/sin table indexed by position. With
    `rotary_dim` < head_dim the frequencies past rotary_dim / 2 are 0 (see head_perm)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device | str,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rotary_dim or head_dim, theta, scaling)
        inv_freq = torch.cat((inv_freq, inv_freq.new_zeros(head_dim // 2 - inv_freq.numel())))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", freqs.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device=device, dtype=dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables [T, 1, D/2], computed once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (any row stride) into a new contiguous tensor."""
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out1, out2 = out.chunk(2, dim=-1)
        torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=out2).addcmul_(x1, sin)
        return out


class LayerRopes(nn.Module):
    """The RoPE tables of a model whose layers may differ in base and scaling (Gemma 3: local
    and global layers): one table per distinct (theta, scaling), looked up once per step."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        keys = [(theta, repr(sorted((scaling or {}).items())))
                for theta, scaling in zip(config.layer_rope_thetas, config.layer_rope_scalings)]
        distinct = list(dict.fromkeys(keys))
        self.layer_table = [distinct.index(key) for key in keys]
        scalings = dict(zip(keys, config.layer_rope_scalings))
        self.tables = nn.ModuleList(
            RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta,
                            scalings[(theta, text)], dtype, device, config.rotary_dim)
            for theta, text in distinct)

    def cos_sin(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) [T, 1, D/2] for this step (shared tables computed once)."""
        tables = [table.cos_sin(positions) for table in self.tables]
        return [tables[i] for i in self.layer_table]
