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
