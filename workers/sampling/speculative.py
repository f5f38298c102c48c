"""Verifying speculative drafts on rank 0: how many draft tokens to keep, and the token after them.

A sequence with k drafts d_0..d_{k-1} owns k + 1 logit rows; row j is the target model's
prediction after the context extended by d_0..d_{j-1}. Greedy rows accept while the draft is
the row's argmax and then take the argmax, exactly what k + 1 sequential greedy steps give.

Sampled rows use rejection sampling for a deterministic (n-gram) proposal. With p_j the row's
distribution after the Sampler's own processing (logit_bias, temperature, min_p, top_k, top_p),
d_j is accepted with probability p_j(d_j); at the first rejection the token is drawn from p_j
with d_j removed and renormalised; if every draft is accepted the bonus token is drawn from the
last row's p. The first output token is then x with probability
p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x), and by induction every later token
follows its row's p given the accepted prefix: the output is distributed as plain sampling.

Each row has two independent uniforms, one for the acceptance test and one for the draw. Seeded
rows take them from (seed, position) alone, the draw's exactly as the Sampler does, so a row
without drafts yields the Sampler's token; unseeded rows take them from the caller's generator,
draws first, so a batch without drafts consumes it as the Sampler would.
"""
from __future__ import annotations

import torch

from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.sampling.draw import (_draw_from_cdf, apply_min_p, sample_full,
                                              sample_top_k_top_p, seeded_uniform)

# Mixed into a seeded row's seed for its acceptance uniform (the draw uses the seed itself).
_ACCEPT_SEED_MIX = 0xD1B54A32D192ED03


def verify_drafts(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                  positions: list[int], generator: torch.Generator) -> list[tuple[int, int]]:
    """(num_accepted, token) per sequence: its new output is drafts[i][:num_accepted] + [token].

    `logits` fp32 [sum(len(d) + 1 for d in drafts), V], sequence i's rows consecutive and in
    order; `positions[i]`: the sequence's length before this step (the Sampler's position), so
    its row j is at positions[i] + j. Penalised params are refused (the drafts are not in the
    history the penalties would need); the scheduler does not draft for them.
    """
    params = [p.with_defaults() for p in params]
    _check(logits, drafts, params, positions)
    seq_of_row = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
    row_params = [params[i] for i in seq_of_row]
    row_drafts = [t for d in drafts for t in (*d, -1)]  # -1: a sequence's last row has none
    logits = _biased(logits.float(), row_params)

    accepted = [False] * len(row_params)
    tokens = [0] * len(row_params)
    greedy = [r for r, p in enumerate(row_params) if p.greedy]
    if greedy:
        best = (logits if len(greedy) == len(row_params) else logits[greedy]).argmax(dim=1).tolist()
        for r, token in zip(greedy, best):
            accepted[r], tokens[r] = row_drafts[r] == token, token
    sampled = [r for r, p in enumerate(row_params) if not p.greedy]
    if sampled:
        row_positions = [positions[i] + j for i, d in enumerate(drafts) for j in range(len(d) + 1)]
        _verify_sampled(logits[sampled], [row_params[r] for r in sampled],
                        [row_drafts[r] for r in sampled], [row_positions[r] for r in sampled],
                        generator, sampled, accepted, tokens)

    results, start = [], 0
    for draft in drafts:
        n = 0
        while n < len(draft) and accepted[start + n]:
            n += 1
        results.append((n, tokens[start + n]))
        start += len(draft) + 1
    return results


def _check(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           positions: list[int]) -> None:
    if not len(drafts) == len(params) == len(positions):
        raise ValueError(f"verify_drafts got {len(drafts)} draft lists but {len(params)} params "
                         f"and {len(positions)} positions")
    num_rows = sum(len(d) + 1 for d in drafts)
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"verify_drafts needs one logit row per draft token plus one per "
                         f"sequence ({num_rows} rows), got logits of shape {tuple(logits.shape)}")
    vocab_size = logits.shape[1]
    for i, (draft, p) in enumerate(zip(drafts, params)):
        if p.uses_penalties:
            raise ValueError(f"sequence {i} uses presence/frequency/repetition penalties, which "
                             f"speculative verification does not support (no drafts for it)")
        if any(not 0 <= t < vocab_size for t in draft):
            raise ValueError(f"sequence {i} has a draft token outside [0, {vocab_size}): {draft}")


def _biased(logits: torch.Tensor, row_params: list[SamplingParams]) -> torch.Tensor:
    """Logits plus each row's logit_bias (as the Sampler adds it); the caller's are unchanged."""
    biased = [r for r, p in enumerate(row_params) if p.logit_bias]
    if not biased:
        return logits
    vocab = logits.shape[1]
    slots = [r * vocab + t for r in biased for t in row_params[r].logit_bias]
    values = [v for r in biased for v in row_params[r].logit_bias.values()]
    out = logits.clone(memory_format=torch.contiguous_format)
    out.view(-1).index_add_(0, torch.tensor(slots, device=out.device),
                            torch.tensor(values, dtype=out.dtype, device=out.device))
    return out


def _verify_sampled(logits: torch.Tensor, params: list[SamplingParams], drafts: list[int],
                    positions: list[int], generator: torch.Generator, rows: list[int],
                    accepted: list[bool], tokens: list[int]) -> None:
    """Fill accepted/tokens at `rows` (the sampled rows; `logits` etc. are theirs, in order):
    a row with a draft gets its acceptance and its residual draw, a last row the Sampler's draw."""
    num_rows, device = len(params), logits.device
    draft_rows = [r for r in range(num_rows) if drafts[r] >= 0]
    draw_u = torch.rand(num_rows, generator=generator, dtype=torch.float64).tolist()
    accept_u = torch.rand(len(draft_rows), generator=generator, dtype=torch.float64).tolist()
    for r, p in enumerate(params):
        if p.seed is not None:
            draw_u[r] = seeded_uniform(p.seed, positions[r])
    for k, r in enumerate(draft_rows):
        if params[r].seed is not None:
            accept_u[k] = seeded_uniform(params[r].seed ^ _ACCEPT_SEED_MIX, positions[r])

    scaled = _scaled(logits, params)
    top_k, top_p = _top_k_top_p(params, logits.shape[1], device)
    uniform = torch.tensor(draw_u, dtype=torch.float32, device=device)  # fp32, as the Sampler's
    last_rows = [r for r in range(num_rows) if drafts[r] < 0]
    last = torch.tensor(last_rows, device=device)
    bonus = _sampler_draw(scaled[last], top_k[last], top_p[last], uniform[last], params, last_rows)
    for r, token in zip(last_rows, bonus):
        tokens[rows[r]] = token
    if not draft_rows:
        return
    index = torch.tensor(draft_rows, device=device)
    probs, ids = _sorted_target_probs(scaled[index], top_k[index], top_p[index])
    is_draft = ids == torch.tensor([drafts[r] for r in draft_rows], device=device).unsqueeze(1)
    draft_probs = (probs * is_draft).sum(dim=1).tolist()
    residual_cdf = probs.masked_fill_(is_draft, 0.0).cumsum_(dim=1)
    choice = _draw_from_cdf(residual_cdf, uniform[index])
    residual = ids.gather(1, choice.unsqueeze(1)).squeeze(1).tolist()
    for k, r in enumerate(draft_rows):
        accepted[rows[r]] = accept_u[k] < draft_probs[k]
        tokens[rows[r]] = residual[k]


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p (a new tensor), as in the Sampler."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32,
                               device=logits.device)
    scaled = logits / temperature.unsqueeze(1)
    if any(p.min_p > 0.0 for p in params):
        apply_min_p(scaled, torch.tensor([p.min_p for p in params], dtype=torch.float32,
                                          device=logits.device))
    return scaled


def _top_k_top_p(params: list[SamplingParams], vocab_size: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row top_k (vocab_size where disabled) and top_p, as the Sampler passes them."""
    top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                         dtype=torch.int64, device=device)
    return top_k, torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)


def _sampler_draw(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  uniform: torch.Tensor, params: list[SamplingParams], rows: list[int]
                  ) -> list[int]:
    """The Sampler's own draw (same helpers, same split into plain and filtered rows)."""
    filtered = torch.tensor([params[r].top_k != -1 or params[r].top_p < 1.0 for r in rows],
                            dtype=torch.bool, device=logits.device)
    tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    if bool((~filtered).any()):
        tokens[~filtered] = sample_full(logits[~filtered], uniform[~filtered])
    if bool(filtered.any()):
        tokens[filtered] = sample_top_k_top_p(logits[filtered], top_k[filtered], top_p[filtered],
                                              uniform[filtered])
    return tokens.tolist()


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution [r, V] (vocabulary order) the Sampler draws each row from: logit_bias,
    temperature, min_p, top_k, top_p applied to `logits` [r, V]. Sampled params only (not
    greedy ones), no penalties."""
    params = [p.with_defaults() for p in params]
    scaled = _scaled(_biased(logits.float(), params), params)
    probs, ids = _sorted_target_probs(scaled, *_top_k_top_p(params, logits.shape[1], logits.device))
    return torch.zeros_like(probs).scatter_(1, ids, probs)


def _sorted_target_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution the Sampler draws from, over the full vocabulary in sorted order.

    `logits` [r, V] already temperature-scaled and min_p-masked; `top_k` [r] int64 (V where
    disabled), `top_p` [r]. Returns (probs, token_ids), both [r, V]: probs zero outside the kept
    set and summing to 1. The rules are `sample_top_k_top_p`'s: the top k renormalised, then
    tokens up to and including the first that brings the (fp32) mass to top_p; ties follow the
    sort order.
    """
    values, ids = logits.sort(dim=1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    values = values.masked_fill_(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = (values - values.logsumexp(dim=1, keepdim=True)).exp_()
    cdf = probs.cumsum(dim=1)
    top_p = torch.where(top_p >= 1.0, 2.0, top_p)  # as in sample_top_k_top_p: never cut the tail
    num_kept = torch.minimum((cdf < top_p.unsqueeze(1)).sum(dim=1) + 1, top_k)
    probs = probs.masked_fill_(rank >= num_kept.unsqueeze(1), 0.0)
    return probs / probs.sum(dim=1, keepdim=True), ids
