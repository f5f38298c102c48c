"""N-gram speculation through EngineCore (the real scheduler, worker and detokenizer in one
process) on a tiny random Llama: sampled outputs keep the target distribution, greedy outputs
are unchanged."""
import collections
import math

import pytest

from pagedserve.pipeline import messages
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.engine_core import EngineCore
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.testing import make_tiny_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=5, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def _run(tiny_dir, spec, prompt, params):
    """Each SamplingParams in `params` as one request; their output token tuples and stats."""
    kw = dict(model=str(tiny_dir), dtype="float32", kv_cache_memory="16MiB", block_size=8,
              max_num_seqs=64, max_num_batched_tokens=512, swap_space=0.0)
    if spec:
        kw["speculative_config"] = spec
    core = EngineCore.build(EngineConfig.from_kwargs(**kw))
    for i, p in enumerate(params):
        core.submit(messages.AddRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                        sampling=p, arrival_time=0.0))
    tokens = collections.defaultdict(list)
    step = 0
    while core.has_unfinished():
        for msg in core.step(float(step)):
            for delta in msg.deltas:
                tokens[delta.request_id] += delta.token_ids
        step += 1
    return [tuple(tokens[f"r{i}"]) for i in range(len(params))], core.scheduler.stats()


def _chi_square(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over tokens seen at least 10 times in all (the rest
    pooled), and its degrees of freedom."""
    both = a + b
    keys = [k for k, n in both.items() if n >= 10]
    rest = lambda c: sum(n for k, n in c.items() if k not in keys)  # noqa: E731
    rows = [(a[k], b[k]) for k in keys] + [(rest(a), rest(b))]
    rows = [r for r in rows if sum(r)]
    na, nb = sum(a.values()), sum(b.values())
    stat = sum((x * math.sqrt(nb / na) - y * math.sqrt(na / nb)) ** 2 / (x + y) for x, y in rows)
    return stat, len(rows) - 1


def test_sampled_tokens_keep_the_distribution_and_greedy_ones_are_unchanged(tiny_dir):
    base = list(range(20, 28)) * 3
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    (reference,), _ = _run(tiny_dir, None, base, [greedy])
    # the prompt's lookup proposes the greedy continuation: drafts the model often accepts
    prompt = base + list(reference[:3]) + list(range(20, 28))
    (plain,), _ = _run(tiny_dir, None, prompt, [greedy])
    (drafted,), stats = _run(tiny_dir, SPEC, prompt, [greedy])
    assert drafted == plain and stats.spec_num_drafts > 0
    n = 2000  # independent samples (other seeds) with and without drafts

    def params(offset):
        return [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.5, seed=offset + i)
                for i in range(n)]
    without, _ = _run(tiny_dir, None, prompt, params(0))
    with_drafts, stats = _run(tiny_dir, SPEC, prompt, params(n))
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # drafts decided tokens
    for pos in (1, 2):  # the first token is sampled at the prompt's end, before any draft
        stat, df = _chi_square(collections.Counter(t[pos] for t in without),
                               collections.Counter(t[pos] for t in with_drafts))
        # far in the tail of chi-square(df) (mean df, sd sqrt(2 df)): p below ~1e-4
        assert stat < df + 5 * math.sqrt(2 * df), (pos, stat, df)
