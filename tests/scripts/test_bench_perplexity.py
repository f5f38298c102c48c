"""scripts/bench_perplexity.py without a model: llama-perplexity's chunks (BOS first where the
model adds one), which tokens each chunk scores, and reading its final estimate."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_perplexity as bp  # noqa: E402


def test_whole_chunks_with_bos_first_and_too_short_a_text_refused():
    ids = list(range(100, 125))                              # 25 tokens: 3 chunks of 8
    assert bp.chunks(ids, 8, None, 3) == [ids[0:8], ids[8:16], ids[16:24]]
    assert bp.chunks(ids, 8, 1, 2) == [[1, *ids[1:8]], [1, *ids[9:16]]]
    with pytest.raises(SystemExit, match="25 tokens: 3 chunks of 8, 4 asked"):
        bp.chunks(ids, 8, None, 4)


def test_the_second_half_of_each_chunk_is_scored_as_llama_perplexity_scores_it():
    # ctx 8: logits at positions 4..6 predict tokens 5..7 (each from >= 4 tokens before it)
    lps = [[-100.0] * 5 + [-1.0, -2.0, -3.0], [-100.0] * 5 + [-0.5, -0.5, -0.5]]
    nll, count = bp.scored(lps, 8)
    assert (nll, count) == (7.5, 6)
    assert math.isclose(math.exp(nll / count), math.exp(1.25))


def test_the_final_estimate_is_read_from_llama_perplexity_output():
    out = "[1]12.3,[2]13.1,\nFinal estimate: PPL = 13.0817 +/- 0.45120\n"
    assert float(bp.FINAL.search(out).group(1)) == 13.0817
