"""KV tiers end to end in one process (EngineCore: the real scheduler and a WorkerCore over a
tiny random Llama): greedy tokens are the same with the tiers off, with blocks back from the
host tier, from disk, after a restart, past a corrupt file and with a disk that refuses every
write."""
import errno
import os

import numpy as np
import pytest

from pagedserve.kv_tier_files import HEADER
from pagedserve.pipeline import messages
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.engine_core import EngineCore
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers import kv_tiers
from pagedserve.workers.testing import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=7, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def _prompts():
    """Three conversations of three turns, taking turns (A1 B1 C1 A2 ...), each turn resending
    its conversation so far (the replies stand in as fixed tokens): more than the device pool
    holds, so a conversation's blocks are evicted before its next turn."""
    rng = np.random.default_rng(11)
    histories = [rng.integers(3, 256, 41).tolist() for _ in range(3)]
    prompts = []
    for _turn in range(3):
        for history in histories:
            prompts.append(list(history))
            history += rng.integers(3, 256, 13).tolist()
    return prompts


def _run(tiny_dir, prompts, **tiers):
    """Each prompt alone, in order (so later ones find earlier ones' blocks); tokens and stats."""
    core = EngineCore.build(EngineConfig.from_kwargs(
        model=str(tiny_dir), dtype="float32", kv_cache_memory=16 * 8 * 2 * 2 * 16 * 4 * 2,
        block_size=8, max_num_seqs=2, max_num_batched_tokens=64, swap_space=0.0, **tiers))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    out, step = [], 0
    for i, prompt in enumerate(prompts):
        core.submit(messages.AddRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                        sampling=params, arrival_time=float(i)))
        tokens = []
        while core.has_unfinished():
            for msg in core.step(float(step)):
                tokens += [t for d in msg.deltas for t in d.token_ids]
            step += 1
        out.append(tokens)
    if core.worker.tiers is not None and core.worker.tiers.writer is not None:
        assert core.worker.tiers.writer.flush(10.0)
    return out, core.stats()


def test_tokens_are_the_same_from_every_tier_and_after_a_restart(tiny_dir, tmp_path, monkeypatch):
    prompts = _prompts()
    expected, off = _run(tiny_dir, prompts)
    assert off["kv_blocks_total"] == 16  # 16 blocks of 8: the conversations do not all fit
    got, host = _run(tiny_dir, prompts, kv_offload_memory="4MiB")
    assert got == expected and host["kv_host_loads"] > 0
    assert host["prompt_tokens"] == off["prompt_tokens"]
    disk_dir = str(tmp_path / "tier")
    got, disk = _run(tiny_dir, prompts, kv_offload_dir=disk_dir)
    assert got == expected and disk["kv_disk_stores"] > 0
    assert os.stat(disk_dir).st_mode & 0o777 == 0o700
    # a restart: a new engine finds every block on disk, the first prompt included
    got, again = _run(tiny_dir, prompts, kv_offload_dir=disk_dir)
    assert got == expected and again["kv_disk_hit_tokens"] >= 3 * 40
    # a corrupt file is refused at load and recomputed: the same tokens
    namespace_dir = os.path.join(disk_dir, os.listdir(disk_dir)[0])
    for name in os.listdir(namespace_dir):
        with open(os.path.join(namespace_dir, name), "r+b") as f:
            f.seek(HEADER.size + 3)
            byte = f.read(1)
            f.seek(HEADER.size + 3)
            f.write(bytes([byte[0] ^ 0xFF]))
    got, corrupt = _run(tiny_dir, prompts, kv_offload_dir=disk_dir)
    assert got == expected and corrupt["kv_disk_failures"] > 0


def test_a_full_disk_degrades_to_recompute(tiny_dir, tmp_path, monkeypatch):
    prompts = _prompts()[:3]
    expected, _ = _run(tiny_dir, prompts)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_tiers, "write_block", full)
    got, stats = _run(tiny_dir, prompts, kv_offload_dir=str(tmp_path / "full"))
    assert got == expected and stats["kv_disk_failures"] == stats["kv_disk_stores"] > 0


def _build(tiny_dir, **tiers):
    return EngineCore.build(EngineConfig.from_kwargs(
        model=str(tiny_dir), dtype="float32", kv_cache_memory=16 * 8 * 2 * 2 * 16 * 4 * 2,
        block_size=8, max_num_seqs=2, max_num_batched_tokens=64, swap_space=0.0, **tiers))


def _serve(core, request_id, prompt):
    core.submit(messages.AddRequest(request_id=request_id, prompt_token_ids=prompt,
                                    sampling=SamplingParams(max_tokens=6, ignore_eos=True,
                                                            temperature=0.0),
                                    arrival_time=0.0))
    tokens, step = [], 0
    while core.has_unfinished():
        tokens += [t for msg in core.step(float(step)) for d in msg.deltas for t in d.token_ids]
        step += 1
    if core.worker.tiers.writer is not None:
        assert core.worker.tiers.writer.flush(10.0)
    return tokens


def test_two_live_replicas_share_the_disk_tier(tiny_dir, tmp_path):
    """Data-parallel replicas on one host: both started on one directory, a prefix that one
    of them computed and wrote is found by the other, which never saw it - the router's
    affinity is a preference, not a requirement."""
    prompt = _prompts()[0]
    expected, _ = _run(tiny_dir, [prompt])
    shared = str(tmp_path / "shared")
    first, second = _build(tiny_dir, kv_offload_dir=shared), _build(tiny_dir, kv_offload_dir=shared)
    assert _serve(first, "a", prompt) == expected[0]
    assert first.stats()["kv_disk_stores"] > 0 and second.stats()["kv_disk_hit_tokens"] == 0
    assert _serve(second, "b", prompt) == expected[0]
    assert second.stats()["kv_disk_hit_tokens"] >= 40 and second.stats()["kv_disk_loads"] > 0
