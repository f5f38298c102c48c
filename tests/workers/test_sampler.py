import math

import pytest
import torch

from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.sampler import Sampler
from pagedserve.workers.sampling.draw import seeded_uniform
from pagedserve.workers.sampling.penalties import apply_penalties, token_occurrences


def run(logits, params, token_ids=None, num_prompt_tokens=None, sampler=None):
    n = logits.shape[0]
    token_ids = token_ids if token_ids is not None else [[1, 2, 3]] * n
    num_prompt_tokens = num_prompt_tokens if num_prompt_tokens is not None else [len(t) for t in token_ids]
    return (sampler or Sampler(seed=0))(logits, params, token_ids, num_prompt_tokens)


def reference_probs(logits_row, *, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Straightforward full-sort reference: temperature -> min_p -> top_k -> top_p, in float64."""
    probs = torch.softmax(logits_row.double() / temperature, dim=0)
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    order = torch.argsort(probs, descending=True)
    if top_k > 0:
        probs[order[top_k:]] = 0.0
    probs = probs / probs.sum()
    mass_before = torch.cumsum(probs[order], 0) - probs[order]
    probs[order[mass_before >= top_p]] = 0.0
    return probs / probs.sum()


def empirical(logits_row, params, num_draws, seed=1):
    """Frequencies of num_draws unseeded draws (one batch of identical rows)."""
    logits = logits_row.unsqueeze(0).expand(num_draws, -1).contiguous()
    out = run(logits, [params] * num_draws, sampler=Sampler(seed=seed))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel())
    return counts.double() / num_draws


def assert_matches(freq, expected, num_draws):
    assert torch.all(freq[expected == 0] == 0), "drew a token outside the allowed set"
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / num_draws) + 1e-3
    assert torch.all((freq - expected).abs() <= tolerance), (freq, expected)


def logits_from_probs(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


# --- seeds -----------------------------------------------------------------------------------

def test_seeded_uniform_depends_on_seed_and_position_only():
    assert seeded_uniform(7, 100) == seeded_uniform(7, 100)
    values = {seeded_uniform(seed, pos) for seed in range(20) for pos in range(20)}
    assert len(values) == 400 and all(0.0 <= v < 1.0 for v in values)
    assert seeded_uniform(-1, 3) != seeded_uniform(2**64 - 1 + 1, 3)  # negative seeds are fine


@pytest.mark.parametrize("params", [
    SamplingParams(seed=42),
    SamplingParams(seed=42, temperature=0.7, top_p=0.9),
    SamplingParams(seed=42, top_k=5, min_p=0.05),
    SamplingParams(seed=42, top_p=0.999),  # flat logits: needs the full-sort fallback
])
def test_seeded_row_is_reproducible_across_batch_compositions(params):
    vocab = 1200
    gen = torch.Generator().manual_seed(3)
    alone, in_batch, other_sampler = [], [], []
    for position in range(5, 17):
        row = torch.randn(vocab, generator=gen) * 0.5
        history = list(range(position))
        alone.append(run(row[None], [params], [history], sampler=Sampler(seed=1)).token_ids[0])
        # The same row at index 2 of a batch of other rows with other params and histories.
        others = torch.randn(4, vocab, generator=gen)
        batch = torch.cat([others[:2], row[None], others[2:]])
        batch_params = [SamplingParams(), SamplingParams(top_p=0.5), params,
                        SamplingParams(temperature=0), SamplingParams(seed=7, top_k=3)]
        histories = [[1], [2, 3], history, [4] * 9, [5] * 30]
        in_batch.append(run(batch, batch_params, histories, sampler=Sampler(seed=2)).token_ids[2])
        # A recompute: a fresh sampler whose shared generator is elsewhere.
        other_sampler.append(run(row[None], [params], [history], sampler=Sampler()).token_ids[0])
    assert alone == in_batch == other_sampler
    assert len(set(alone)) > 5  # the draws do vary with position


def test_different_seeds_give_different_tokens():
    row = torch.zeros(1, 1000)
    draws = {run(row, [SamplingParams(seed=s)]).token_ids[0] for s in range(50)}
    assert len(draws) > 40


# --- greedy, temperature, filters --------------------------------------------------------

def test_top_k_1_equals_greedy():
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(0))
    greedy = run(logits, [SamplingParams(temperature=0.0)] * 32).token_ids
    top_k_1 = run(logits, [SamplingParams(temperature=1.3, top_k=1)] * 32).token_ids
    assert greedy == top_k_1 == logits.argmax(dim=1).tolist()


def test_sampler_does_not_modify_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    run(logits, [SamplingParams(repetition_penalty=1.5, presence_penalty=1.0),
                 SamplingParams(temperature=0.5, top_p=0.8, min_p=0.1),
                 SamplingParams(temperature=0, logprobs=3)])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scaling(temperature):
    row = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    params = SamplingParams(temperature=temperature)
    n = 20000
    assert_matches(empirical(row, params, n), reference_probs(row, temperature=temperature), n)


def test_top_p_keeps_the_nucleus_and_renormalises():
    row = logits_from_probs([0.04, 0.4, 0.1, 0.25, 0.06, 0.15])
    n = 20000
    freq = empirical(row, SamplingParams(top_p=0.75), n)
    # Nucleus {0.4, 0.25, 0.15} (mass 0.8 >= 0.75), renormalised.
    expected = torch.tensor([0, 0.4, 0, 0.25, 0, 0.15], dtype=torch.float64) / 0.8
    assert torch.allclose(reference_probs(row, top_p=0.75), expected)
    assert_matches(freq, expected, n)


def test_min_p_keeps_tokens_above_the_scaled_max_and_renormalises():
    row = logits_from_probs([0.05, 0.45, 0.2, 0.12, 0.18])
    n = 20000
    freq = empirical(row, SamplingParams(min_p=0.3), n)
    # Threshold 0.3 * 0.45 = 0.135: keeps 0.45, 0.2, 0.18.
    expected = torch.tensor([0, 0.45, 0.2, 0, 0.18], dtype=torch.float64) / 0.83
    assert_matches(freq, expected, n)


def test_top_k_then_top_p_on_the_renormalised_top_k():
    row = logits_from_probs([0.3, 0.25, 0.2, 0.15, 0.1])
    n = 20000
    # top_k=3 -> {.3, .25, .2}/.75 = {.4, .333, .267}; top_p=0.7 -> {.4, .333} (mass .733).
    expected = torch.tensor([0.3, 0.25, 0, 0, 0], dtype=torch.float64) / 0.55
    assert torch.allclose(reference_probs(row, top_k=3, top_p=0.7), expected)
    assert_matches(empirical(row, SamplingParams(top_k=3, top_p=0.7), n), expected, n)


@pytest.mark.parametrize("case", ["peaked", "flat"])
@pytest.mark.parametrize("params", [
    dict(top_p=0.9), dict(top_k=40), dict(top_k=300, top_p=0.95), dict(top_p=0.8, min_p=0.02),
    dict(temperature=0.6, top_k=1200, top_p=0.97),
])
def test_filters_match_reference_on_a_large_vocabulary(case, params):
    # A large vocabulary exercises every candidate width: top-64, top-1024 and the full sort.
    vocab, n = 1200, 2000
    gen = torch.Generator().manual_seed(11)
    scale = 3.0 if case == "peaked" else 0.3
    row = torch.randn(vocab, generator=gen) * scale
    expected = reference_probs(row, **params)
    freq = empirical(row, SamplingParams(**params), n)
    assert torch.all(freq[expected == 0] == 0), "drew a token outside the allowed set"
    # Compare the mass on the 10 most likely allowed tokens and on the rest of the set.
    top = torch.argsort(expected, descending=True)[:10]
    tolerance = 5 * torch.sqrt(expected[top] * (1 - expected[top]) / n) + 1e-3
    assert torch.all((freq[top] - expected[top]).abs() <= tolerance)


# --- penalties ---------------------------------------------------------------------------

def test_token_occurrences_are_distinct_slots_with_output_counts():
    slots, output_counts = token_occurrences([[1, 1, 2, 3, 3, 3], [0, 4]], [3, 2], vocab_size=5,
                                             rows=[0, 2])
    # Row 0 holds 1, 2 (prompt) and 3 (prompt once, output 3 times); row 2 holds 0 and 4.
    assert slots.tolist() == [1, 2, 3, 10, 14]
    assert output_counts.tolist() == [0, 0, 3, 0, 0]


def test_penalties_change_logits_exactly_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0],
                           [1.0, 1.0, -1.0, -1.0, 0.0]])
    # Row 0: prompt [0, 1], output [3, 3, 4]; row 1: prompt [2], output [0].
    slots, output_counts = token_occurrences([[0, 1, 3, 3, 4], [2, 0]], [2, 1], vocab_size=5)
    out = apply_penalties(logits.clone(), slots, output_counts,
                          presence=torch.tensor([0.5, 0.0]), frequency=torch.tensor([0.25, 1.0]),
                          repetition=torch.tensor([2.0, 1.0]))
    expected = torch.tensor([
        # seen -> /2 if positive, *2 if negative; then output counts: 3 twice, 4 once
        [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.25 * 2 - 0.5, -2.0 * 2 - 0.25 * 1 - 0.5],
        # repetition 1: unchanged; frequency 1 on token 0 (output once); prompt-only 2 untouched
        [1.0 - 1.0, 1.0, -1.0, -1.0, 0.0],
    ])
    assert torch.allclose(out, expected)


def test_penalties_match_a_dense_reference_on_random_histories():
    gen = torch.Generator().manual_seed(2)
    num_rows, vocab = 6, 40
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    histories = [torch.randint(0, vocab, (int(n),), generator=gen).tolist()
                 for n in torch.randint(1, 60, (num_rows,), generator=gen)]
    prompt_lens = [len(h) // 2 for h in histories]
    presence, frequency = torch.rand(num_rows, generator=gen), torch.rand(num_rows, generator=gen)
    repetition = 0.5 + torch.rand(num_rows, generator=gen)
    slots, output_counts = token_occurrences(histories, prompt_lens, vocab)
    out = apply_penalties(logits.clone(), slots, output_counts, presence, frequency, repetition)
    expected = logits.clone()
    for row, (history, n_prompt) in enumerate(zip(histories, prompt_lens)):
        for token in set(history):
            value = expected[row, token]
            value = value / repetition[row] if value > 0 else value * repetition[row]
            count = history[n_prompt:].count(token)
            expected[row, token] = value - frequency[row] * count - presence[row] * (count > 0)
    assert torch.allclose(out, expected, atol=1e-5)


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0, -5.0]])
    history, prompt_len = [0, 2], 2  # token 0 only in the prompt
    pick = lambda **kw: run(logits, [SamplingParams(temperature=0, **kw)], [history],
                            [prompt_len]).token_ids[0]
    assert pick() == 0
    assert pick(repetition_penalty=1.5) == 1          # 2.0 / 1.5 < 1.5
    assert pick(presence_penalty=2.0) == 0            # prompt tokens are not output tokens
    out_history = [2, 0]                              # token 0 now in the output, once
    assert run(logits, [SamplingParams(temperature=0, frequency_penalty=0.6)], [out_history],
               [1]).token_ids[0] == 1


# --- logprobs ----------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_and_top_n_ordered():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.3),
              SamplingParams(),
              SamplingParams(logprobs=0, temperature=0),
              SamplingParams(logprobs=20, top_k=3, seed=1)]
    out = run(logits, params, [[1, 2, 3, 50]] * 4, [2] * 4)
    reference = torch.log_softmax(logits.double(), dim=1)
    for row in (0, 2, 3):
        token = out.token_ids[row]
        assert out.logprobs[row] == pytest.approx(reference[row, token].item(), abs=1e-5)
    assert math.isnan(out.logprobs[1]) and out.top_logprobs[1] == []
    assert out.top_logprobs[2] == []
    for row, n in ((0, 5), (3, 20)):
        top = out.top_logprobs[row]
        assert len(top) == n
        expected_ids = torch.argsort(reference[row], descending=True)[:n].tolist()
        assert [t for t, _ in top] == expected_ids
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        for token, value in top:
            assert value == pytest.approx(reference[row, token].item(), abs=1e-5)


def test_no_logprobs_when_no_row_asks():
    out = run(torch.randn(2, 10), [SamplingParams(), SamplingParams(temperature=0)])
    assert out.logprobs is None and out.top_logprobs is None


# --- mixed batches -----------------------------------------------------------------------

def test_each_row_gets_its_own_treatment():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 300, generator=gen) * 2
    history = [[5, 6, 7, int(logits[3].argmax())]] * 6
    params = [SamplingParams(temperature=0),
              SamplingParams(top_k=1, temperature=1.5),
              SamplingParams(seed=3, top_p=0.6),
              SamplingParams(temperature=0, repetition_penalty=2.0),
              SamplingParams(top_k=2),
              SamplingParams(seed=4, min_p=0.5, temperature=0.8)]
    out = run(logits, params, history, [3] * 6)
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[1] == logits[1].argmax()
    assert out.token_ids[3] != logits[3].argmax()  # penalised away from its own argmax
    assert out.token_ids[4] in logits[4].topk(2).indices.tolist()
    for row in range(6):
        if params[row].seed is not None or params[row].greedy:
            alone = run(logits[row:row + 1], [params[row]], [history[row]], [3])
            assert alone.token_ids[0] == out.token_ids[row]


def test_logit_bias_moves_the_choice_and_leaves_logprobs_raw():
    import math

    from pagedserve.pipeline.sampling_params import SamplingParams as SP
    from pagedserve.workers.sampler import Sampler

    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, 0.5]])
    before = logits.clone()
    out = Sampler(seed=0)(logits, [SP(temperature=0, logit_bias={2: 5.0}, logprobs=0),
                                   SP(temperature=0, logit_bias={1: -100.0})],
                          [[1], [1]], [1, 1])
    assert out.token_ids == [2, 2]
    assert torch.equal(logits, before)  # the caller's logits are untouched
    assert math.isclose(out.logprobs[0], torch.log_softmax(before[0], 0)[2].item(), rel_tol=1e-6)
    # a sampled row never draws a token biased to -100
    draws = Sampler(seed=1)(logits[:1].repeat(64, 1), [SP(temperature=1.0, logit_bias={0: -100.0})] * 64,
                            [[1]] * 64, [1] * 64)
    assert 0 not in draws.token_ids


def test_logit_bias_is_validated():
    from pagedserve.pipeline.sampling_params import SamplingParams as SP

    with pytest.raises(ValueError, match="logit_bias contains 9, outside the vocabulary"):
        SP(logit_bias={9: 1.0}).validate(vocab_size=8)
    with pytest.raises(ValueError, match=r"logit_bias value for token 1 must be a number in \[-100, 100\]"):
        SP(logit_bias={1: 101.0}).validate()
    with pytest.raises(ValueError, match="stop_token_ids contains -1, which is not a token id"):
        SP(stop_token_ids=[-1]).validate()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05, seed=3),
    SamplingParams(temperature=1.3, top_p=0.9, presence_penalty=0.5, seed=4),
    SamplingParams(temperature=0.6, top_k=2000, seed=5, logprobs=2),
    SamplingParams(temperature=0.8, seed=6, logit_bias={5: 3.0}),
])
def test_in_place_and_deferred_temperature_draw_what_scaling_every_row_first_draws(params):
    """The worker lets the sampler change its logits (`may_modify`), and rows with top_k/top_p
    divide only their candidates by the temperature: the tokens and logprobs are those of the
    plain way - penalties on a copy, every row divided, then the filters - row for row."""
    torch.manual_seed(0)
    logits = torch.randn(6, 3000) * 4
    histories = [[(7 * r + j) % 3000 for j in range(40)] for r in range(6)]
    rows = [params] * 6
    kept = run(logits.clone(), rows, histories, [20] * 6)
    changed = logits.clone()
    fast = Sampler(seed=0)(changed, rows, histories, [20] * 6, may_modify=True)
    assert fast.token_ids == kept.token_ids
    assert fast.logprobs == kept.logprobs and fast.top_logprobs == kept.top_logprobs
    # the plain way, written out: every row scaled before the filters
    p = params.with_defaults()
    slots, counts = token_occurrences(histories, [20] * 6, 3000)
    ref = logits.clone()
    if p.uses_penalties:
        full = torch.full((6,), 1.0)
        ref = apply_penalties(ref, slots, counts, presence=full * p.presence_penalty,
                              frequency=full * p.frequency_penalty,
                              repetition=full * p.repetition_penalty)
    for token, bias in (p.logit_bias or {}).items():
        ref[:, token] += bias
    from pagedserve.workers.sampling.draw import sample_full, sample_top_k_top_p
    scaled = ref / p.temperature
    uniform = torch.tensor([seeded_uniform(p.seed, 40)] * 6)
    if p.top_k == -1 and p.top_p >= 1.0:
        want = sample_full(scaled, uniform)
    else:
        k = p.top_k if p.top_k > 0 else 3000
        want = sample_top_k_top_p(scaled, torch.full((6,), k), torch.full((6,), p.top_p),
                                  uniform)
    assert fast.token_ids == want.tolist()


def test_logits_made_in_inference_mode_are_penalised_in_place():
    """The model's forward runs under torch.inference_mode: its logits may only be changed in
    place inside inference mode, which the sampler enters itself (a worker calls it outside)."""
    with torch.inference_mode():
        logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={4: 2.0})] * 3
    want = Sampler(seed=0)(logits.clone(), params, [[1, 2, 3]] * 3, [2] * 3).token_ids
    got = Sampler(seed=0)(logits, params, [[1, 2, 3]] * 3, [2] * 3, may_modify=True).token_ids
    assert got == want
