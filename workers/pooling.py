"""Pooling: the final hidden states of an embedding prompt's rows into one vector
(pipeline/pooling.py says which rows: LAST, MEAN or CLS), L2-normalized when the model's
pooler says so. One gather (LAST, CLS) or one scatter-add (MEAN) for all of a step's prompts."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.pipeline.pooling import PoolerConfig


def pool_hidden(hidden: torch.Tensor, spans: np.ndarray, pooler: PoolerConfig) -> torch.Tensor:
    """hidden [T, H] of a step's rows, spans [k, 2] (first row, end row) of each pooling prompt
    (its rows in the step: the whole prompt for MEAN and CLS, its last chunk for LAST) ->
    fp32 [k, H], in span order."""
    starts, ends = spans[:, 0], spans[:, 1]
    device = hidden.device
    if pooler.pooling_type == "LAST":
        pooled = hidden[torch.from_numpy(ends - 1).to(device)].float()
    elif pooler.pooling_type == "CLS":
        pooled = hidden[torch.from_numpy(starts).to(device)].float()
    else:  # MEAN
        lengths = ends - starts
        rows = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        segment = np.repeat(np.arange(len(spans)), lengths)
        sums = torch.zeros(len(spans), hidden.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, torch.from_numpy(segment).to(device),
                        hidden[torch.from_numpy(rows).to(device)].float())
        pooled = sums / torch.from_numpy(lengths).to(device, torch.float32)[:, None]
    return F.normalize(pooled, dim=-1) if pooler.normalize else pooled
