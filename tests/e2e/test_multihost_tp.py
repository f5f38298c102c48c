"""Tensor parallelism across hosts: two network namespaces joined by a veth pair are the two
hosts; node 0 runs the group with rank 0, node 1 only rank 1 (`--nnodes 2`)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from e2e import netns
from pagedserve import SamplingParams
from pagedserve.pipeline.client import EngineClient

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
PROMPTS = [[1, 104, 75, 82, 49, 14], [1, 42, 43, 44, 45], [1, 98, 12, 7, 201, 99, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)   # still running at the kill


def _launcher(hosts, node: int, model_dir, folder: Path, port: int, secret: Path):
    cmd = hosts.command(node, sys.executable, "-m", "pagedserve.pipeline.launch",
                        "--model", str(model_dir), "--dtype", "float32", "--quantization", "none",
                        "--kv-cache-memory", "2MiB", "--swap-space", "0.002", "--cpu-threads", "1",
                        "--no-http", "--tensor-parallel-size", "2", "--nnodes", "2",
                        "--node-rank", str(node), "--master-addr", hosts.addresses[0],
                        "--master-port", str(port), "--cluster-secret-file", str(secret),
                        "--ipc-dir", str(folder / f"ipc{node}"), "--die-with-parent")
    log = open(folder / f"node{node}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """Two layers: few all-reduces per step, so the test pays for the group, not the model."""
    from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
    from pagedserve.workers.testing import make_tiny_llama
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=5, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_model):
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    hosts = netns.TwoHosts.create()
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-multihost-"))
    secret = folder / "secret"
    secret.write_bytes(os.urandom(24).hex().encode())
    secret.chmod(0o600)
    nodes, client = [], None
    try:
        nodes = [_launcher(hosts, n, tiny_model, folder, 29500 + os.getpid() % 1000 * 2, secret)
                 for n in (0, 1)]
        client = EngineClient(f"ipc://{folder}/ipc0/frontend.sock",
                              f"ipc://{folder}/ipc0/output.sock", connect_timeout=600)
        deadline = time.monotonic() + 600
        while not client.health(timeout=2):
            assert all(n.poll() is None for n in nodes), (folder / "node0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the two-host group did not become healthy"
            time.sleep(0.5)
        yield hosts, nodes, client, folder
    finally:
        if client is not None:
            client.close()
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                assert node.wait(timeout=60) == 0
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        hosts.remove()
        shutil.rmtree(folder, ignore_errors=True)


def greedy(client, prompts=PROMPTS) -> list[list[int]]:
    futures = [client.submit(p, GREEDY) for p in prompts]
    return [f.result(timeout=300).outputs[0].token_ids for f in futures]


@pytest.fixture(scope="module")
def tp1_outputs(tiny_model):
    """{params: greedy token ids of PROMPTS} from one rank, in process."""
    from pagedserve import LLM
    with LLM(model=str(tiny_model), in_process=True, dtype="float32", quantization="none",
             kv_cache_memory="2MiB", swap_space=0.002) as llm:
        return {params.max_tokens: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
                for params in (GREEDY, LONG)}


def test_tp2_across_two_hosts_equals_tp1_and_binds_only_the_given_addresses(cluster, tp1_outputs):
    hosts, _, client, _ = cluster
    assert greedy(client) == tp1_outputs[GREEDY.max_tokens]
    assert client.stats()["steps_planned_ahead"] > 0  # overlapped across the two hosts
    for node in (0, 1):   # rendezvous, plans and gloo: on the node's own address only
        listening = hosts.listening(node)
        assert listening and all(a.startswith(hosts.addresses[node] + ":") for a in listening), \
            listening


def test_a_peer_with_a_wrong_secret_is_refused_and_logged(cluster, tp1_outputs):
    hosts, nodes, client, folder = cluster
    plan_addr = f"tcp://{hosts.addresses[0]}:{29500 + os.getpid() % 1000 * 2 + 1}"
    subprocess.run(hosts.command(1, sys.executable, str(HERE / "stranger.py"), plan_addr, "2"),
                   check=True, timeout=120, cwd=HERE.parents[1])
    log = (folder / "node0.log").read_text()
    assert "refused" in log and "a peer without the cluster secret" in log, log[-3000:]
    assert "dropped a WorkerReady" not in log       # nothing of theirs reached the scheduler
    assert client.stats()["unknown_messages"] == [] or all(
        row["type"] != "WorkerReady" for row in client.stats()["unknown_messages"])
    assert greedy(client, PROMPTS[:1]) == tp1_outputs[GREEDY.max_tokens][:1]


def _pid_of(launcher: subprocess.Popen, role: str) -> int:
    for child in psutil.Process(launcher.pid).children():
        if child.environ().get("PAGEDSERVE_ROLE") == role:
            return child.pid
    raise LookupError(role)


def test_a_worker_killed_on_the_remote_host_recovers(cluster, tp1_outputs):
    """SIGKILL of rank 1 on node 1 mid-stream: node 1 restarts it, node 0's rank 0 loses the
    step and the group is rebuilt; the requests complete with the clean run's tokens."""
    _, nodes, client, folder = cluster
    before = client.stats()["generation_tokens"]
    futures = [client.submit(p, LONG) for p in PROMPTS]
    deadline = time.monotonic() + 120
    while client.stats()["generation_tokens"] < before + 3 * 5:    # mid-stream
        assert time.monotonic() < deadline and not any(f.done() for f in futures)
        time.sleep(0.05)
    os.kill(_pid_of(nodes[1], "worker1"), signal.SIGKILL)
    try:
        outputs = [f.result(timeout=300).outputs[0].token_ids for f in futures]
    except TimeoutError:   # the nodes' own account of the recovery, before the fixture deletes it
        pytest.fail("no recovery in 300 s\n" + "\n".join(
            f"--- node{n}.log ---\n" + (folder / f"node{n}.log").read_text()[-6000:]
            for n in (0, 1)) + f"\nstats: {client.stats()}")
    assert outputs == tp1_outputs[LONG.max_tokens]
    assert client.stats()["restarts"].get("worker", 0) >= 1
