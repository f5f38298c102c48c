"""The chaos soak, short: streams keep flowing while random roles are killed or frozen, and
nothing is lost, duplicated or changed (scripts/chaos_soak.py runs the long version)."""
from __future__ import annotations


import pytest

from script_module import load_script

pytestmark = pytest.mark.slow

def test_short_chaos_soak_loses_nothing():
    soak = load_script("chaos_soak")
    result = soak.main(["--duration", "15", "--streams", "8", "--interval", "4", "7",
                        "--workload", "16", "--max-tokens", "8", "24", "--tp", "2",
                        "--seed", "3", "--min-faults", "2", "--no-store"])
    assert result["faults"] >= 2
    assert (result["lost"], result["duplicated_tokens"], result["differing"]) == (0, 0, 0)
    assert result["completed"] > 0 and result["http_lost"] == 0 and result["http_5xx"] == 0
    assert result["kv_blocks_used_at_end"] == 0 and result["group_exit_code"] == 0
    start, end = result["resources_start"], result["resources_end"]
    assert end["shm_segments"] == start["shm_segments"]
    assert end["processes"] == start["processes"]
