"""bench_serving and bench_throughput draw their ShareGPT prompts from the whole file: they used
to read only the first max(8 N, 1000) conversations."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvmanager"))
from test_sharegpt_reader import write_truncated  # noqa: E402


class WordTokenizer:
    """A few tokens per text, the first the entry's number ("p17 words" -> [17, 0, 0, 0])."""

    def encode(self, text, add_special_tokens=True):
        words = text.split()
        return [int(words[0][1:])] + [0] * (len(words) + 1)


def entry_index(prompt: str) -> int:
    return int(prompt.split()[0][1:])


def test_bench_serving_prompts_come_from_beyond_the_head(tmp_path):
    import bench_serving

    path = tmp_path / "sharegpt.json"
    write_truncated(path, 3000)
    reqs = bench_serving.sample_sharegpt(20, WordTokenizer(), max_output_tokens=64,
                                         max_prompt_tokens=64, seed=0, dataset=str(path))
    assert len(reqs) == 20
    assert sum(entry_index(r.prompt) >= 1000 for r in reqs) >= 5


def test_bench_throughput_prompts_come_from_beyond_the_head(tmp_path):
    import bench_throughput

    path = tmp_path / "sharegpt.json"
    write_truncated(path, 3000)
    reqs = bench_throughput.sample_requests(WordTokenizer(), 20, seed=0, prompt_format="raw",
                                            max_prompt_len=64, max_total_len=128,
                                            dataset=str(path))
    assert len(reqs) == 20
    assert sum(r.prompt_ids[0] >= 1000 for r in reqs) >= 5
