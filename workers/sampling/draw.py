"""Drawing one token per row from temperature-scaled logits, with min_p, top_k and top_p.

How a token is drawn: inverse-CDF sampling (the algorithm behind `torch.multinomial`), written
out so that each row's single uniform number comes from its own source. A seeded row's uniform is
a pure function of (seed, position), so it is the same whatever else is in the batch, after a
recompute and on any device. We do not use the exponential race (argmax(probs / Exp(1))): it
needs one random number per vocabulary entry, and on CPU filling [256, 49152] with
`exponential_` takes ~500 ms, `torch.multinomial` ~550 ms, while softmax + cumsum + searchsorted
takes ~55 ms. The cumulative sum is fp32, as in `torch.multinomial` on CUDA: a token's
probability is exact to about 1e-7.

top_k / top_p work in a sorted candidate space: `topk(64)`, then `topk(1024)`, and only for the
rows still undecided a full sort; on CPU the top-k is the native one-pass kernel
(kernels/native_topk.py: ~0.02 ms a 152K row against torch's ~0.3). A row is decided at a width once its top_k fits in it, or (top_p
without top_k) once the candidates' true probability mass reaches top_p, so peaked
distributions never pay for a full sort of the vocabulary. Ties at the cut-off follow sort order.
"""
from __future__ import annotations

import torch

from pagedserve.kernels.native_topk import topk_or_torch

_MASK64 = (1 << 64) - 1
_CANDIDATE_WIDTHS = (64, 1024)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) determined by (seed, position) alone."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) * (1.0 / (1 << 53))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf, in place) tokens whose probability is below min_p times the row's top one.

    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), so no softmax is needed.
    """
    threshold = logits.amax(dim=1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _draw_from_cdf(cdf: torch.Tensor, uniform: torch.Tensor,
                   num_candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the first entry of each row whose cumulative mass exceeds uniform * kept mass.

    `cdf` [r, W] is a row-wise cumulative sum; only its first `num_candidates[i]` entries count.
    The target stays strictly below the kept mass, so a zero-probability entry is never chosen.
    """
    if num_candidates is None:
        kept_mass = cdf[:, -1]
    else:
        kept_mass = cdf.gather(1, (num_candidates - 1).unsqueeze(1)).squeeze(1)
    target = torch.minimum(uniform * kept_mass, torch.nextafter(kept_mass, torch.zeros_like(kept_mass)))
    choice = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return choice.clamp_(max=cdf.shape[1] - 1)


def sample_full(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` [r, V] (already temperature-scaled), no top_k/top_p."""
    cdf = torch.softmax(logits, dim=1).cumsum_(dim=1)
    return _draw_from_cdf(cdf, uniform)


def sample_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       uniform: torch.Tensor, temperature: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """One token per row among the top_k tokens, then the top_p nucleus of their renormalised
    distribution (HF/vLLM order). `top_k` [r] int64 holds V where disabled, `top_p` [r] 1.0.

    `temperature` [r] (> 0; None: `logits` are scaled already): a positive temperature keeps
    the order, so candidates are picked from the raw logits and only theirs are divided - the
    same numbers as dividing the whole row first, without a pass over the vocabulary per row
    whose top_k fits in the candidates.
    """
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    # A disabled top_p compares against 2 so float rounding of the cumsum never cuts the tail.
    top_p = torch.where(top_p >= 1.0, 2.0, top_p)
    pending = torch.arange(num_rows, device=logits.device)
    for width in (*[w for w in _CANDIDATE_WIDTHS if w < vocab_size], vocab_size):
        rows = logits if pending.numel() == num_rows else logits[pending]
        row_top_k, row_top_p = top_k[pending], top_p[pending]
        if width == vocab_size:
            values, candidate_ids = rows.sort(dim=1, descending=True)
        else:
            values, candidate_ids = topk_or_torch(rows, width)
        if temperature is not None:
            row_temperature = temperature[pending].unsqueeze(1)
            values = values / row_temperature
        in_top_k = torch.arange(width, device=logits.device) < row_top_k.unsqueeze(1)
        values = values.masked_fill_(~in_top_k, float("-inf"))
        # Probabilities after top_k: normalised over the top k when they are all here, else
        # (top_k disabled) over the whole row.
        top_k_fits = row_top_k <= width
        log_norm = values.logsumexp(dim=1)
        if not bool(top_k_fits.all()):
            if not bool(top_k_fits.any()):
                log_norm = _scaled(rows, row_temperature if temperature is not None
                                   else None).logsumexp(dim=1)
            else:
                unbounded = (~top_k_fits).nonzero().squeeze(1)
                log_norm[unbounded] = _scaled(
                    rows[unbounded], None if temperature is None
                    else row_temperature[unbounded]).logsumexp(dim=1)
        cdf = (values - log_norm.unsqueeze(1)).exp_().cumsum_(dim=1)
        # Nucleus: keep tokens up to and including the first that brings the mass to top_p.
        nucleus = (cdf < row_top_p.unsqueeze(1)).sum(dim=1) + 1
        num_kept = torch.minimum(nucleus, row_top_k.clamp(max=width))
        decided = top_k_fits | (cdf[:, -1] >= row_top_p)
        choice = _draw_from_cdf(cdf, uniform[pending], num_kept)
        chosen = candidate_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
        tokens[pending[decided]] = chosen[decided]
        pending = pending[~decided]
        if pending.numel() == 0:
            break
    return tokens


def _scaled(rows: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    return rows if temperature is None else rows / temperature
