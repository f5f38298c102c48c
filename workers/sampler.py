"""Batched sampling over one step's logits: one token per row, each row with its own params.

Per row, in order: presence/frequency/repetition penalties -> greedy argmax, or temperature ->
min_p -> top_k -> top_p -> a draw (see `workers/sampling/draw.py` for how and why). Each stage
runs only on the rows that need it, with its per-row parameters gathered into tensors once per
call; an all-greedy batch without penalties or logprobs is a single argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.native_topk import topk_or_torch
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.sampling.draw import apply_min_p, sample_full, sample_top_k_top_p, seeded_uniform
from pagedserve.workers.sampling.penalties import apply_penalties, token_occurrences


@dataclass
class SamplerOutput:
    token_ids: list[int]                                  # one per row
    logprobs: list[float] | None                          # chosen token's; nan for rows that
                                                          # did not ask; None if no row asked
    top_logprobs: list[list[tuple[int, float]]] | None    # per row top-N, [] if it did not ask


class Sampler:
    """Samples one token per row of a step's logits [N, V].

    Logprobs are those of the raw model logits (log_softmax before penalties, temperature and
    filtering), which is what vLLM returns by default. Seeded rows draw their randomness from
    (seed, len(token_ids)) only; unseeded rows share one generator (seeded by `seed` if given).
    """

    def __init__(self, *, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 token_ids: list[list[int]], num_prompt_tokens: list[int],
                 may_modify: bool = False) -> SamplerOutput:
        """`may_modify`: the caller reads `logits` no more, so penalties and biases may be
        applied to them in place instead of to a copy of the whole [N, V] (fp32 rows). The
        model's logits are inference tensors: only inference mode may change them in place."""
        with torch.inference_mode():
            return self._sample(logits, params, token_ids, num_prompt_tokens, may_modify)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                token_ids: list[list[int]], num_prompt_tokens: list[int],
                may_modify: bool) -> SamplerOutput:
        num_rows = logits.shape[0]
        if not (len(params) == len(token_ids) == len(num_prompt_tokens) == num_rows):
            raise ValueError(f"sampler got {num_rows} logit rows but {len(params)} params, "
                             f"{len(token_ids)} token lists, {len(num_prompt_tokens)} prompt lengths")
        # the scheduler's admission fills unset fields; params built by hand may leave them
        params = [p.with_defaults() for p in params]
        raw_logits = logits.float()
        # Logprobs are the raw logits': taken before anything changes them.
        raw_logprobs = _raw_logprobs(raw_logits, params)
        logits = self._penalised(raw_logits, params, token_ids, num_prompt_tokens,
                                 in_place=may_modify or raw_logits is not logits)

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) < num_rows:
            chosen = topk_or_torch(logits, 1)[1].squeeze(1)  # argmax, first maximum
        else:
            chosen = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            rows = logits if len(random_rows) == num_rows else logits[index]
            drawn = self._draw([params[i] for i in random_rows], rows,
                               [len(token_ids[i]) for i in random_rows])
            chosen[index] = drawn

        token_list = chosen.tolist()
        logprobs, top_logprobs = _logprobs(raw_logprobs, chosen, params)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs, top_logprobs=top_logprobs)

    def _penalised(self, logits: torch.Tensor, params: list[SamplingParams],
                   token_ids: list[list[int]], num_prompt_tokens: list[int],
                   in_place: bool) -> torch.Tensor:
        """Penalties, then logit biases; `logits` are changed only `in_place`."""
        out = self._with_penalties(logits, params, token_ids, num_prompt_tokens, in_place)
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if not biased:
            return out
        if out is logits and not (in_place and logits.is_contiguous()):
            out = logits.clone(memory_format=torch.contiguous_format)
        vocab = out.shape[1]
        slots = [row * vocab + token for row in biased for token in params[row].logit_bias]
        values = [v for row in biased for v in params[row].logit_bias.values()]
        out.view(-1).index_add_(0, torch.tensor(slots, device=out.device),
                                torch.tensor(values, dtype=out.dtype, device=out.device))
        return out

    def _with_penalties(self, logits: torch.Tensor, params: list[SamplingParams],
                        token_ids: list[list[int]], num_prompt_tokens: list[int],
                        in_place: bool) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if not rows:
            return logits
        slots, output_counts = token_occurrences(
            [token_ids[i] for i in rows], [num_prompt_tokens[i] for i in rows],
            logits.shape[1], rows, logits.device)
        target = logits if in_place and logits.is_contiguous() else logits.clone(
            memory_format=torch.contiguous_format)
        return apply_penalties(
            target, slots, output_counts,
            presence=_row_tensor([p.presence_penalty for p in params], logits.device),
            frequency=_row_tensor([p.frequency_penalty for p in params], logits.device),
            repetition=_row_tensor([p.repetition_penalty for p in params], logits.device))

    def _draw(self, params: list[SamplingParams], logits: torch.Tensor,
              positions: list[int]) -> torch.Tensor:
        """Sample rows that are not greedy; returns a new tensor, `logits` is left untouched."""
        device = logits.device
        vocab_size = logits.shape[1]
        use_min_p = any(p.min_p > 0.0 for p in params)
        # Rows with top_k / top_p divide only their candidates by the temperature (the order
        # does not change); a whole row is divided only where min_p or a full draw needs it.
        temperature = None
        if any(p.temperature != 1.0 for p in params):
            temperature = _row_tensor([p.temperature for p in params], device)
            if use_min_p:
                logits, temperature = logits / temperature.unsqueeze(1), None
        elif use_min_p:
            logits = logits.clone()  # min_p masks in place; the caller's tensor stays intact
        if use_min_p:
            apply_min_p(logits, _row_tensor([p.min_p for p in params], device))

        uniform = torch.rand(len(params), generator=self.generator, dtype=torch.float64).tolist()
        for row, p in enumerate(params):
            if p.seed is not None:
                uniform[row] = seeded_uniform(p.seed, positions[row])
        uniform = _row_tensor(uniform, device)

        filtered = [i for i, p in enumerate(params) if p.top_k != -1 or p.top_p < 1.0]
        if not filtered:
            return sample_full(_scaled(logits, temperature), uniform)
        tokens = torch.empty(len(params), dtype=torch.int64, device=device)
        plain = [i for i in range(len(params)) if params[i].top_k == -1 and params[i].top_p >= 1.0]
        if plain:
            index = torch.tensor(plain, device=device)
            tokens[index] = sample_full(
                _scaled(logits[index], None if temperature is None else temperature[index]),
                uniform[index])
        index = torch.tensor(filtered, device=device)
        top_k = torch.tensor([min(params[i].top_k, vocab_size) if params[i].top_k > 0 else vocab_size
                              for i in filtered], dtype=torch.int64, device=device)
        top_p = _row_tensor([params[i].top_p for i in filtered], device)
        rows = logits if len(filtered) == len(params) else logits[index]
        tokens[index] = sample_top_k_top_p(rows, top_k, top_p, uniform[index],
                                           None if temperature is None else temperature[index])
        return tokens


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _scaled(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    return logits if temperature is None else logits / temperature.unsqueeze(1)


def _raw_logprobs(raw_logits: torch.Tensor, params: list[SamplingParams]
                  ) -> torch.Tensor | None:
    """log_softmax of the raw logits of the rows that ask for logprobs (None: none asks)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    if len(rows) == len(params):
        return torch.log_softmax(raw_logits, dim=1)
    return torch.log_softmax(raw_logits[torch.tensor(rows, device=raw_logits.device)], dim=1)


def _logprobs(logprobs: torch.Tensor | None, chosen: torch.Tensor, params: list[SamplingParams]
              ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """Raw-logit logprobs (`_raw_logprobs`) of the chosen tokens and the top-N, for the rows
    that ask."""
    if logprobs is None:
        return None, None
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    index = torch.tensor(rows, device=chosen.device)
    chosen_logprobs = logprobs.gather(1, chosen[index].unsqueeze(1)).squeeze(1).tolist()
    max_top = max(params[i].logprobs for i in rows)
    if max_top > 0:
        top_values, top_ids = logprobs.topk(max_top, dim=1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()

    chosen_out = [float("nan")] * len(params)
    top_out: list[list[tuple[int, float]]] = [[] for _ in params]
    for j, row in enumerate(rows):
        chosen_out[row] = chosen_logprobs[j]
        n = params[row].logprobs
        if n:
            top_out[row] = list(zip(top_ids[j][:n], top_values[j][:n]))
    return chosen_out, top_out
