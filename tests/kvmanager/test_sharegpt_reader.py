"""The benchmark's ShareGPT reader on a small truncated file (no network)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import sharegpt  # noqa: E402


def test_reader_stops_at_the_cut_and_keeps_first_turn_pairs(tmp_path):
    path = tmp_path / sharegpt.DATA_FILENAME
    path.write_text(
        '[\n {"id": "a", "conversations": [{"from": "human", "value": "hi"},'
        ' {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"}]},\n'
        ' {"id": "b", "conversations": [{"from": "gpt", "value": "x"},'
        ' {"from": "human", "value": "y"}]},\n'
        ' {"id": "c", "conversations": [{"from": "human", "value": "  "},'
        ' {"from": "gpt", "value": "z"}]},\n'
        ' {"id": "d", "conversations": [{"from": "human", "value": "q"},'
        ' {"from": "gpt", "value": "r"}]},\n'
        ' {"id": "e", "conversations": [{"from": "human", "value": "cut of')
    assert [e["id"] for e in sharegpt.iter_entries(path)] == ["a", "b", "c", "d"]
    assert list(sharegpt.first_turns(path)) == [("hi", "hello"), ("q", "r")]
    assert list(sharegpt.first_turns(path, limit=1)) == [("hi", "hello")]
    assert sharegpt.dataset_path(tmp_path) == path  # already there: no fetch


def test_reader_handles_a_complete_array(tmp_path):
    path = tmp_path / "full.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "a"},'
                    ' {"from": "gpt", "value": "b"}]}]')
    assert list(sharegpt.first_turns(path)) == [("a", "b")]


def write_truncated(path, n: int) -> None:
    """n complete conversations "p<i>" -> "r<i>", then one cut off mid-entry."""
    entries = [f'{{"id": "{i}", "conversations": [{{"from": "human", "value": "p{i} words"}}, '
               f'{{"from": "gpt", "value": "r{i} reply words"}}]}}' for i in range(n)]
    path.write_text("[\n" + ",\n".join(entries) + ',\n {"id": "cut", "conversations": [{"fr')


def test_sample_draws_from_the_whole_file_not_its_head(tmp_path):
    path = tmp_path / "sharegpt.json"
    write_truncated(path, 3000)
    sample = sharegpt.sample_first_turns(50, seed=0, path=path)
    indices = [int(p.split()[0][1:]) for p, _ in sample]
    assert len(set(indices)) == 50
    # The old reader kept the first max(8 N, 1000) conversations only.
    assert sum(i >= 1000 for i in indices) > 20
    assert all(r.startswith(f"r{i} ") for i, (_, r) in zip(indices, sample))
    assert indices != sorted(indices)  # a random order, not the file's


def test_sample_is_seeded(tmp_path):
    path = tmp_path / "sharegpt.json"
    write_truncated(path, 500)
    assert sharegpt.sample_first_turns(20, 1, path) == sharegpt.sample_first_turns(20, 1, path)
    assert sharegpt.sample_first_turns(20, 1, path) != sharegpt.sample_first_turns(20, 2, path)


def test_sample_larger_than_the_file_is_all_of_it_shuffled(tmp_path):
    path = tmp_path / "sharegpt.json"
    write_truncated(path, 30)
    sample = sharegpt.sample_first_turns(100, seed=0, path=path)
    assert sorted(sample) == sorted(sharegpt.first_turns(path)) and len(sample) == 30
