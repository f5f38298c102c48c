"""Start N tensor-parallel worker ranks as real processes and drive them with step plans.

For tests and benchmarks: every rank builds its ModelRunner + WorkerCore, joins the
torch.distributed group, and executes the same StepPlan; rank 0's StepResult comes back. Plans
and results cross the pipes as msgpack (never pickle); the ZeroMQ worker process is separate.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import msgspec

from pagedserve.pipeline.messages import StepPlan, StepResult

log = logging.getLogger(__name__)
_OK, _NONE, _ERROR, _READY = b"o", b"n", b"e", b"r"


@dataclass(frozen=True, slots=True)
class RankSpec:
    model_dir: str
    dtype: str = "float32"          # torch dtype name
    device: str = "cpu"             # "cuda" puts rank r on cuda:r
    block_size: int = 16
    num_blocks: int = 256
    num_cpu_blocks: int = 0
    sampler_seed: int | None = 0
    quantization: str = "none"      # or int8 (ModelRunner)


def _rank_main(rank: int, size: int, init_method: str, spec: RankSpec, conn: Connection) -> None:
    try:
        import torch

        from pagedserve.workers.distributed import destroy_distributed, init_distributed
        from pagedserve.workers.loader import load_config
        from pagedserve.workers.model_runner import ModelRunner
        from pagedserve.workers.sampler import Sampler
        from pagedserve.workers.core import WorkerCore

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: gloo on loopback only
        device = f"cuda:{rank}" if spec.device == "cuda" else spec.device
        init_distributed(rank, size, init_method, device)
        runner = ModelRunner(load_config(spec.model_dir), spec.model_dir, getattr(torch, spec.dtype),
                             device, spec.block_size, spec.num_blocks, rank, size,
                             quantization=spec.quantization)
        core = WorkerCore(runner, Sampler(seed=spec.sampler_seed) if rank == 0 else None,
                          spec.num_cpu_blocks)
        conn.send_bytes(_READY)
        decoder = msgspec.msgpack.Decoder(StepPlan)
        while True:
            try:
                message = conn.recv_bytes()
            except EOFError:
                break
            result = core.execute(decoder.decode(message))
            conn.send_bytes(_NONE if result is None else _OK + msgspec.msgpack.encode(result))
        destroy_distributed()
    except BaseException:
        try:
            conn.send_bytes(_ERROR + traceback.format_exc().encode())
        except OSError:
            pass                                 # the driver is gone; nobody to tell
        raise SystemExit(1) from None


class TPWorkers:
    """`tp_size` worker rank processes (spawned) executing the same plans in lockstep."""

    def __init__(self, spec: RankSpec, tp_size: int, *, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        # A file store in a private temp folder: no socket listens for the rendezvous
        self._store_dir = tempfile.mkdtemp(prefix="pagedserve-tp-")
        init_method = f"file://{os.path.join(self._store_dir, 'rendezvous')}"
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        for rank in range(tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, name=f"tp-rank-{rank}", daemon=True,
                               args=(rank, tp_size, init_method, spec, child))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            for rank in range(tp_size):
                self._receive(rank)
        except BaseException:
            self.close()
            raise
        log.info("tp workers ready: %d ranks, pids %s", tp_size, [p.pid for p in self._procs])

    def execute(self, plan: StepPlan) -> StepResult | None:
        message = msgspec.msgpack.encode(plan)
        for conn in self._conns:
            conn.send_bytes(message)
        replies, errors = [], []
        for rank in range(len(self._conns)):       # hear every rank before raising
            try:
                replies.append(self._receive(rank))
            except (RuntimeError, TimeoutError) as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return replies[0]

    def _receive(self, rank: int) -> StepResult | None:
        conn, proc = self._conns[rank], self._procs[rank]
        if not wait([conn, proc.sentinel], self.timeout_s):
            raise TimeoutError(f"tp rank {rank} gave no reply within {self.timeout_s:.0f} s")
        if not conn.poll():
            proc.join(timeout=5)
            raise RuntimeError(f"tp rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}")
        reply = conn.recv_bytes()
        kind, body = reply[:1], reply[1:]
        if kind == _ERROR:
            raise RuntimeError(f"tp rank {rank} failed:\n{body.decode()}")
        if kind == _OK:
            return msgspec.msgpack.decode(body, type=StepResult)
        return None

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conns, self._procs = [], []
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def __enter__(self) -> TPWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
