"""Bidirectional attention over a step's whole inputs (an encoder's), each input attending over
itself only.

One SDPA call per input is slow for many short inputs (a call's overhead, 12 heads of a few
rows), and one padded call over all of them wastes the padding's quadratic work. So inputs are
grouped by length, longest first, each group padded to its longest input while the padding stays
under PAD_SHARE of its rows: one masked SDPA call per group, an input alone unmasked. The groups
are worked out once per step (`plan_groups`) and used by every layer (`attend`); the result is
the per-input attention's (tests/workers/test_pooling_models.py compares them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAD_SHARE = 0.25      # padded rows a group may add, as a share of its real rows
MAX_GROUP = 64        # inputs per group


@dataclass(slots=True)
class Group:
    rows: torch.Tensor          # [n * width] the step row of each padded slot (padding: row 0)
    valid: torch.Tensor | None  # the slots that hold a real row, in order (None: all)
    mask: torch.Tensor | None   # [n, 1, 1, width] keys a query may see (None: no padding)
    n: int
    width: int
    span: tuple[int, int] | None = None  # a lone input's rows: sliced, not gathered


def plan_groups(spans: list[tuple[int, int]], device) -> list[Group]:
    """Groups of inputs (row spans of the step) for `attend`."""
    order = sorted(spans, key=lambda s: s[0] - s[1])  # longest first
    groups, i = [], 0
    while i < len(order):
        width = order[i][1] - order[i][0]
        j, real = i + 1, width
        while j < len(order) and j - i < MAX_GROUP:
            length = order[j][1] - order[j][0]
            if (j - i + 1) * width > (1 + PAD_SHARE) * (real + length):
                break
            real += length
            j += 1
        groups.append(_group(order[i:j], width, device))
        i = j
    return groups


def _group(members: list[tuple[int, int]], width: int, device) -> Group:
    if len(members) == 1:
        return Group(torch.empty(0), None, None, 1, width, members[0])
    lengths = torch.tensor([b - a for a, b in members])
    starts = torch.tensor([a for a, _ in members])
    slot = torch.arange(width)
    valid = slot[None, :] < lengths[:, None]                       # [n, width]
    rows = torch.where(valid, starts[:, None] + slot[None, :], 0)
    full = bool(valid.all())
    slots = None if full else valid.reshape(-1).nonzero().squeeze(1).to(device)
    return Group(rows.reshape(-1).to(device), slots,
                 None if full else valid[:, None, None, :].to(device), len(members), width)


def attend(qkv: torch.Tensor, groups: list[Group]) -> torch.Tensor:
    """qkv [T, 3, heads, head_dim] (queries, keys, values) -> attention output [T, heads,
    head_dim]. A group's rows are gathered once, q, k and v together."""
    out = qkv.new_empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])
    for g in groups:
        if g.span is not None:
            a, b = g.span
            q, k, v = qkv[a:b].permute(1, 2, 0, 3)  # each [heads, rows, head_dim]
            out[a:b] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
            continue
        heads, dim = qkv.shape[2], qkv.shape[3]
        gathered = qkv.index_select(0, g.rows).view(g.n, g.width, 3, heads, dim)
        q, k, v = gathered.permute(2, 0, 3, 1, 4)  # each [n, heads, width, head_dim]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask)
        o = o.transpose(1, 2).reshape(g.n * g.width, heads, dim)
        if g.valid is None:
            out.index_copy_(0, g.rows, o)
        else:
            out.index_copy_(0, g.rows.index_select(0, g.valid), o.index_select(0, g.valid))
    return out
