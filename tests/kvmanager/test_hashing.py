import subprocess
import sys
from pathlib import Path

from pagedserve.kvmanager import hash_block_tokens, hash_full_blocks


def test_hash_chains_parent_tokens_and_salt():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], cache_salt="")
    assert hash_block_tokens(None, [1, 2, 3, 4], "a") != hash_block_tokens(None, [1, 2, 3, 4], "b")
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, h1]
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, start=1, parent_hash=h0) == [h1]


def test_hash_is_stable_across_processes():
    code = ("from pagedserve.kvmanager import hash_block_tokens;"
            "print(hash_block_tokens(None, [7, 8, 9], 'salt').hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == hash_block_tokens(None, [7, 8, 9], "salt").hex()
