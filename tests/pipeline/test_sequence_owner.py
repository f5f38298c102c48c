"""One owner per piece of scheduler state: a Sequence's fields change only through its own
methods (pipeline/scheduler/sequence.py). The scheduler's other modules decide and call those
transitions; none assigns a field. Checked on the source, so a new direct write fails here."""
import ast
import sys
from pathlib import Path

from pagedserve.pipeline.scheduler.sequence import Sequence

ROOT = Path(__file__).resolve().parents[2]
# Modules that hold Sequence objects: the scheduler and the KV manager it drives.
SCANNED = [*sorted((ROOT / "pipeline" / "scheduler").glob("*.py")),
           *sorted((ROOT / "kvmanager").glob("*.py"))]
# The fields no other object in those modules has (token_ids, index, request and seq_id are
# set once, by the constructor, and shared with messages that carry the same names).
OWNED = set(Sequence.__slots__) - {"seq_id", "request", "index", "token_ids", "num_prompt_tokens"}


def writes_outside_the_owner() -> list[str]:
    found = []
    for path in SCANNED:
        if path.name == "sequence.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and leaf.attr in OWNED:
                        found.append(f"{path.relative_to(ROOT)}:{leaf.lineno} .{leaf.attr}")
    return found


def test_only_the_sequence_writes_its_fields():
    assert writes_outside_the_owner() == []


def test_the_check_finds_a_direct_write(tmp_path, monkeypatch):
    bad = tmp_path / "scheduler_module.py"
    bad.write_text("def plan(seq):\n    seq.lane_cap = 3\n    seq.num_kv_tokens += 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SCANNED", [bad])
    assert writes_outside_the_owner() == ["scheduler_module.py:2 .lane_cap",
                                          "scheduler_module.py:3 .num_kv_tokens"]
