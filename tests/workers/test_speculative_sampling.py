"""verify_drafts: exact greedy verification, the Sampler's distribution, and rejection sampling
that preserves the target distribution (statistical checks with fixed seeds, shown to have power
against a wrong residual)."""
import math

import msgspec
import pytest
import torch

from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.sampler import Sampler
from pagedserve.workers.sampling.speculative import target_probs, verify_drafts

GREEDY = SamplingParams(temperature=0.0)


def verify(logits, drafts, params, positions=None, seed=0):
    positions = positions if positions is not None else [10] * len(drafts)
    return verify_drafts(logits, drafts, params, positions, torch.Generator().manual_seed(seed))


def reference_probs(logits_row, p):
    """Straightforward float64 reference: bias -> temperature -> min_p -> top_k -> top_p."""
    logits = logits_row.double().clone()
    for token, bias in p.logit_bias.items():
        logits[token] += bias
    probs = torch.softmax(logits / (p.temperature if p.temperature is not None else 1.0), dim=0)
    min_p = p.min_p or 0.0
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    order = torch.argsort(probs, descending=True)
    if p.top_k is not None and p.top_k > 0:
        probs[order[p.top_k:]] = 0.0
    probs = probs / probs.sum()
    mass_before = torch.cumsum(probs[order], 0) - probs[order]
    probs[order[mass_before >= (p.top_p if p.top_p is not None else 1.0)]] = 0.0
    return probs / probs.sum()


# --- greedy ----------------------------------------------------------------------------------

def sequential_greedy(rows, draft):
    """What plain greedy decoding emits over these rows: stop after the first token that is not
    the draft's (or after the last row)."""
    out = []
    for j in range(len(draft) + 1):
        out.append(int(rows[j].argmax()))
        if j == len(draft) or out[-1] != draft[j]:
            return out


def test_greedy_accepts_the_matching_prefix_and_corrects_after_it():
    torch.manual_seed(0)
    k, vocab = 4, 50
    logits = torch.randn(5 * (k + 1), vocab)
    best = logits.argmax(dim=1).view(5, k + 1).tolist()
    drafts = []
    for m in range(k + 1):  # sequence m matches its first m rows, then differs
        drafts.append(best[m][:m] + [(best[m][j] + 1) % vocab for j in range(m, k)])
    results = verify(logits, drafts, [GREEDY] * 5)
    assert results == [(m, best[m][m]) for m in range(k + 1)]  # m == k: the last row's bonus


def test_greedy_without_drafts_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(1))
    results = verify(logits, [[]] * 6, [GREEDY, SamplingParams(top_k=1, temperature=1.0)] * 3)
    assert results == [(0, t) for t in logits.argmax(dim=1).tolist()]


def test_greedy_equals_a_sequential_greedy_decode():
    gen = torch.Generator().manual_seed(2)
    vocab, drafts, rows = 40, [], []
    for i in range(200):
        seq_rows = torch.randn(1 + i % 6, vocab, generator=gen)
        best = seq_rows.argmax(dim=1).tolist()
        keep = torch.rand(len(best) - 1, generator=gen) < 0.75
        drafts.append([b if ok else (b + 3) % vocab for b, ok in zip(best, keep.tolist())])
        rows.append(seq_rows)
    results = verify(torch.cat(rows), drafts, [GREEDY] * len(drafts))
    for seq_rows, draft, (n, token) in zip(rows, drafts, results):
        assert draft[:n] + [token] == sequential_greedy(seq_rows, draft)


def test_greedy_applies_logit_bias_as_the_sampler_does():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.0, logit_bias={5: 100.0, 7: 3.0})
    plain = Sampler(seed=0)(logits, [params] * 4, [[1]] * 4, [1] * 4).token_ids
    assert plain == [5] * 4
    assert verify(logits, [[5, 5, 5]], [params]) == [(3, 5)]


# --- the Sampler's distribution --------------------------------------------------------------

SAMPLED_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(top_p=0.8),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.6),
    SamplingParams(min_p=0.1, top_p=0.95),
    SamplingParams(temperature=0.8, top_k=5, logit_bias={3: 2.5, 90: -1.0}),
    SamplingParams(temperature=1.1, min_p=0.05, top_k=30, top_p=0.9, logit_bias={11: 4.0}),
]


@pytest.mark.parametrize("params", SAMPLED_PARAMS)
def test_target_probs_are_the_samplers_distribution(params):
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(4)) * 2
    probs = target_probs(logits, [params] * 6)
    for row in range(6):
        torch.testing.assert_close(probs[row].double(), reference_probs(logits[row], params),
                                   atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("params", SAMPLED_PARAMS)
def test_rows_without_drafts_draw_what_the_sampler_draws(params, seeded):
    """Token for token: seeded rows from (seed, position), unseeded ones from the same generator
    state; 64 < V so the Sampler's top_k/top_p rows go through its candidate widths."""
    num_rows, vocab = 300, 100
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(5)) * 2
    row_params = [msgspec.structs.replace(params, seed=1000 + i) if seeded else params
                  for i in range(num_rows)]
    positions = [7 + i % 13 for i in range(num_rows)]
    expected = Sampler(seed=6)(logits, row_params, [[0] * n for n in positions],
                               [1] * num_rows).token_ids
    results = verify(logits, [[]] * num_rows, row_params, positions, seed=6)
    assert results == [(0, t) for t in expected]
    assert len(set(expected)) > 1


# --- distribution preservation ---------------------------------------------------------------

def max_deviation(tokens, expected):
    """Largest |frequency - p| in standard errors over the vocabulary; inf if a token of
    probability 0 was drawn or a sequence stopped early (-1: fewer tokens than conditioned on)."""
    n = tokens.numel()
    if bool((tokens < 0).any()):
        return math.inf
    freq = torch.bincount(tokens, minlength=expected.numel()).double() / n
    if bool((freq[expected == 0] > 0).any()):
        return math.inf
    stderr = torch.sqrt(expected * (1 - expected) / n) + 1e-4
    return float(((freq - expected).abs() / stderr).max())


def check_outputs(outputs, drafts, target, accepted_first):
    """outputs [N, 3]: each sequence's first three tokens (-1 where it emitted fewer);
    target [3, V]: the rows' distributions. Returns the deviations to check."""
    first_is_d1 = outputs[:, 0] == drafts[0]
    both = first_is_d1 & (outputs[:, 1] == drafts[1])
    n = outputs.shape[0]
    rate = accepted_first.double().mean()
    rate_stderr = math.sqrt(target[0, drafts[0]] * (1 - target[0, drafts[0]]) / n) + 1e-4
    assert int(both.sum()) > 1000, "too few samples reach the third row; pick likelier drafts"
    return {"first": max_deviation(outputs[:, 0], target[0]),
            "second | first == d1": max_deviation(outputs[first_is_d1, 1], target[1]),
            "third | first two == drafts": max_deviation(outputs[both, 2], target[2]),
            "acceptance rate": abs(float(rate) - float(target[0, drafts[0]])) / rate_stderr}


def run_verify(rows, draft, params, num_seqs, seeded=False):
    """num_seqs copies of one 3-row sequence (2 drafts) in one call."""
    logits = rows.repeat(num_seqs, 1)
    params_list = [msgspec.structs.replace(params, seed=77 + i) if seeded else params
                   for i in range(num_seqs)]
    positions = [50 + i % 5 for i in range(num_seqs)]
    results = verify(logits, [draft] * num_seqs, params_list, positions, seed=8)
    outputs = torch.tensor([(draft[:n] + [token, -1, -1])[:3] for n, token in results])
    accepted_first = torch.tensor([n >= 1 for n, _ in results])
    return outputs, accepted_first


def simulate(target, draft, num_seqs, *, residual=True, seed=9):
    """A reference rejection sampler in the test (plain torch); `residual=False` is the
    deliberately wrong one that redraws from p itself after a rejection."""
    gen = torch.Generator().manual_seed(seed)
    outputs = torch.full((num_seqs, 3), -1, dtype=torch.int64)
    alive, accepted_first = torch.ones(num_seqs, dtype=torch.bool), None
    for j, p in enumerate(target):
        if j < len(draft):
            u = torch.rand(num_seqs, generator=gen, dtype=torch.float64)
            accept = alive & (u < p[draft[j]])
            outputs[accept, j] = draft[j]
            redraw = p.clone()
            if residual:
                redraw[draft[j]] = 0.0
        else:
            accept, redraw = torch.zeros_like(alive), p
        stop = alive & ~accept
        outputs[stop, j] = torch.multinomial(redraw.float(), int(stop.sum()), replacement=True,
                                             generator=gen)
        accepted_first = accept if j == 0 else accepted_first
        alive = accept
    return outputs, accepted_first


def make_case(case):
    """Three rows over V = 8 with distributions chosen by hand (drafts of moderate probability)."""
    probs = torch.tensor([[0.05, 0.42, 0.2, 0.11, 0.08, 0.06, 0.045, 0.035],  # no ties, so
                          [0.27, 0.06, 0.12, 0.38, 0.07, 0.05, 0.03, 0.02],  # top_k cuts are
                          [0.09, 0.13, 0.11, 0.07, 0.22, 0.18, 0.06, 0.14]])  # unambiguous
    logits = torch.log(probs)
    params = {"plain": SamplingParams(),
              "filtered": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, logit_bias={4: 0.3}),
              "seeded": SamplingParams(temperature=1.2, min_p=0.1, top_p=0.95)}[case]
    target = torch.stack([reference_probs(row, params) for row in logits])
    return logits, params, target, [1, 3]


NUM_SEQS = 20000
THRESHOLD = 5.0  # standard errors; fixed seeds make each check deterministic


@pytest.mark.parametrize("case", ["plain", "filtered", "seeded"])
def test_rejection_sampling_preserves_the_target_distribution(case):
    logits, params, target, draft = make_case(case)
    outputs, accepted_first = run_verify(logits, draft, params, NUM_SEQS, seeded=case == "seeded")
    deviations = check_outputs(outputs, draft, target, accepted_first)
    assert max(deviations.values()) < THRESHOLD, deviations


def test_the_statistic_catches_a_wrong_residual():
    logits, params, target, draft = make_case("filtered")
    outputs, accepted_first = simulate(target, draft, NUM_SEQS)
    right = check_outputs(outputs, draft, target, accepted_first)
    assert max(right.values()) < THRESHOLD, right  # the reference sampler passes ...
    outputs, accepted_first = simulate(target, draft, NUM_SEQS, residual=False)
    wrong = check_outputs(outputs, draft, target, accepted_first)
    assert wrong["first"] > 4 * THRESHOLD, wrong  # ... a residual without d removed fails


def test_a_draft_outside_the_kept_set_is_never_accepted_and_a_sure_one_always():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2)).repeat(500, 1)
    top2 = SamplingParams(top_k=2)
    results = verify(logits, [[2]] * 500, [top2] * 500)
    assert all(n == 0 and token in (0, 1) for n, token in results)
    only_top = SamplingParams(top_p=0.1)
    assert verify(logits, [[0]] * 500, [only_top] * 500) == [(1, 0)] * 500


# --- seeds, mixed batches, errors ------------------------------------------------------------

def test_seeded_results_depend_only_on_seed_and_positions():
    gen = torch.Generator().manual_seed(10)
    rows = torch.randn(4, 12, generator=gen)
    draft = rows[:3].argmax(dim=1).tolist()  # likely drafts, so some get accepted
    params = SamplingParams(temperature=1.5, seed=123)
    alone = [verify(rows, [draft], [params], [pos], seed=s)[0] for pos in range(40) for s in (0, 1)]
    others = torch.randn(6, 12, generator=gen)
    for pos in range(40):
        batch = torch.cat([others[:3], rows, others[3:]])
        results = verify(batch, [[1, 2], draft, [4, 5]],
                         [SamplingParams(), params, SamplingParams(seed=5, top_k=3)],
                         [3, pos, 9], seed=pos)
        assert results[1] == alone[2 * pos] == alone[2 * pos + 1]
    assert len(set(alone)) > 3  # positions matter


def test_mixed_batch_matches_separate_calls():
    gen = torch.Generator().manual_seed(11)
    greedy_rows, sampled_rows = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
    seeded = SamplingParams(top_p=0.9, seed=3)
    greedy_draft = greedy_rows[:2].argmax(dim=1).tolist()
    mixed = verify(torch.cat([greedy_rows, sampled_rows]), [greedy_draft, [4, 4]],
                   [GREEDY, seeded], [20, 30])
    assert mixed[0] == verify(greedy_rows, [greedy_draft], [GREEDY])[0]
    assert mixed[0] == (2, int(greedy_rows[2].argmax()))
    assert mixed[1] == verify(sampled_rows, [[4, 4]], [seeded], [30])[0]


@pytest.mark.parametrize("params", [SamplingParams(presence_penalty=0.5),
                                    SamplingParams(frequency_penalty=-0.2, temperature=0.0),
                                    SamplingParams(repetition_penalty=1.2)])
def test_penalised_params_are_refused(params):
    with pytest.raises(ValueError, match="penalties"):
        verify(torch.zeros(2, 8), [[1]], [params])


def test_shape_and_token_errors():
    with pytest.raises(ValueError, match=r"\(3 rows\)"):
        verify(torch.zeros(2, 8), [[1, 2]], [GREEDY])
    with pytest.raises(ValueError, match="params"):
        verify(torch.zeros(2, 8), [[1]], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="outside"):
        verify(torch.zeros(2, 8), [[8]], [GREEDY])
