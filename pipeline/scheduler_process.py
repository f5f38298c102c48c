"""Scheduler role: `python -m pipeline.scheduler_process --config-json ...`.

Sockets: a ROUTER for clients (AddRequest/Abort/UtilityCall), a ROUTER for the worker ranks
(StepPlan out to every rank, StepResult back from rank 0), a PULL for the detokenizer's
StopMatched/Abort, and a PUSH to the detokenizer (DetokOpen/TokenBatch). While the workers
compute a step the loop keeps taking requests, aborts and utility calls; the next plan is built
the moment the result arrives. With nothing to do it blocks on its sockets.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import zmq

from pipeline import ipc, messages
from pipeline.config import EngineConfig
from pipeline.procutil import die_with_parent, load_config, role_arg_parser, setup_logging
from pipeline.scheduler import Scheduler, SchedulerConfig
from pipeline.scheduler_service import SchedulerService

log = setup_logging("scheduler")
IDLE_POLL_MS = 1000  # only to notice a drain signal; no work is done when idle


def worker_identity(rank: int) -> bytes:
    return f"worker{rank}".encode()


def scheduler_config(cfg: EngineConfig, max_model_len: int) -> SchedulerConfig:
    s = cfg.scheduling
    return SchedulerConfig(
        max_model_len=max_model_len, block_size=cfg.cache.block_size,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=max(s.max_num_batched_tokens, s.max_num_seqs),
        enable_chunked_prefill=s.enable_chunked_prefill,
        enable_prefix_caching=cfg.cache.enable_prefix_caching,
        max_queued_requests=s.max_queued_requests, preemption_mode=s.preemption_mode,
        policy=s.scheduling_policy)


class SchedulerProcess:
    def __init__(self, cfg: EngineConfig):
        from workers.loader import load_config as load_model_config
        self.cfg = cfg
        self.model_config = load_model_config(cfg.model.model)
        self.max_model_len = cfg.model.max_model_len or self.model_config.max_position_embeddings
        self.tp_size = cfg.parallel.tensor_parallel_size
        self.ctx = zmq.Context()
        self.frontend = ipc.make_socket(self.ctx, zmq.ROUTER, cfg.ipc.frontend_addr, bind=True)
        self.workers = ipc.make_socket(self.ctx, zmq.ROUTER, cfg.ipc.plan_addr, bind=True)
        self.events = ipc.make_socket(self.ctx, zmq.PULL, cfg.ipc.events_addr, bind=True)
        self.detok = ipc.make_socket(self.ctx, zmq.PUSH, cfg.ipc.detok_addr, bind=False)
        self.control = ipc.make_socket(self.ctx, zmq.PUSH, cfg.ipc.control_addr, bind=False)
        self.block_tables = None
        self.service: SchedulerService | None = None
        self.inflight: messages.StepPlan | None = None
        self.stop_requested = False

    # -- start-up ------------------------------------------------------------------------------
    def wait_for_workers(self) -> tuple[int, int]:
        ready: dict[int, messages.WorkerReady] = {}
        while len(ready) < self.tp_size:
            if not self.workers.poll(IDLE_POLL_MS):
                if self.stop_requested:
                    raise SystemExit(0)
                continue
            _, msg = ipc.recv_routed(self.workers)
            if isinstance(msg, messages.WorkerReady):
                ready[msg.rank] = msg
            elif isinstance(msg, messages.WorkerFailed):
                raise RuntimeError(f"worker rank {msg.rank} failed to start: {msg.message}")
        return (min(r.num_gpu_blocks for r in ready.values()),
                min(r.num_cpu_blocks for r in ready.values()))

    def build(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        from kvmanager import SharedBlockTables
        sconf = scheduler_config(self.cfg, self.max_model_len)
        max_blocks = -(-self.max_model_len // sconf.block_size)
        tag = os.path.basename(self.cfg.ipc.ipc_dir) or f"pagedserve-{os.getpid()}"
        # A row per sequence holding blocks: running ones plus swapped ones (>= 1 host block each).
        self.block_tables = SharedBlockTables(sconf.max_num_seqs + num_cpu_blocks, max_blocks,
                                              name=f"{tag}_bt")
        scheduler = Scheduler.from_config(sconf, num_gpu_blocks, num_cpu_blocks,
                                          eos_token_ids=self.model_config.eos_token_ids,
                                          block_tables=self.block_tables)
        self.service = SchedulerService(
            scheduler,
            send_to_client=lambda cid, msg: ipc.send(self.frontend, msg, identity=cid),
            send_to_detok=lambda msg: ipc.send(self.detok, msg))
        log.info("KV cache: %d device blocks, %d host blocks of %d tokens; max model len %d",
                 num_gpu_blocks, num_cpu_blocks, sconf.block_size, self.max_model_len)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        num_gpu, num_cpu = self.wait_for_workers()
        self.build(num_gpu, num_cpu)
        ipc.send(self.control, messages.ProcessReady("scheduler", 0, os.getpid(),
                                                     f"{num_gpu} KV blocks"))
        poller = zmq.Poller()
        for sock in (self.frontend, self.workers, self.events):
            poller.register(sock, zmq.POLLIN)
        service = self.service
        while True:
            if self.stop_requested and not service.draining:
                service.draining = True
                log.info("draining: %d request(s) in flight", len(service.scheduler.requests))
            if service.draining and self.inflight is None and not service.scheduler.has_unfinished():
                return 0
            busy = self.inflight is None and service.scheduler.has_unfinished()
            events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
            if self.workers in events:
                self._drain_workers()
            if self.frontend in events:
                self._drain_frontend()
            if self.events in events:
                self._drain_events()
            if self.inflight is None and service.scheduler.has_unfinished():
                self._start_step()

    def _start_step(self) -> None:
        scheduler = self.service.scheduler
        plan = scheduler.schedule(time.time())
        if not (plan.scheduled or plan.new_seqs or plan.swap_out or plan.swap_in or plan.copy
                or plan.forks or plan.finished_seq_ids):
            # Nothing can run now (e.g. waiting for blocks that an abort will free).
            scheduler.update(plan, messages.StepResult(plan.step_id, [], [], None, None), time.time())
            return
        frames = ipc.encode(plan)
        for rank in range(self.tp_size):
            self.workers.send_multipart([worker_identity(rank), *frames], copy=False)
        self.inflight = plan

    def _drain_workers(self) -> None:
        while True:
            try:
                _, msg = ipc.recv_routed(self.workers, zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(msg, messages.StepResult):
                plan, self.inflight = self.inflight, None
                if plan is None or plan.step_id != msg.step_id:
                    raise RuntimeError(f"result for step {msg.step_id} but step "
                                       f"{None if plan is None else plan.step_id} is in flight")
                self.service.on_step_result(plan, msg)
            elif isinstance(msg, messages.WorkerFailed):
                raise RuntimeError(f"worker rank {msg.rank} failed at step {msg.step_id}: {msg.message}")

    def _drain_frontend(self) -> None:
        service = self.service
        while True:
            try:
                client_id, msg = ipc.recv_routed(self.frontend, zmq.NOBLOCK)
            except zmq.Again:
                return
            except ipc.WireError as exc:
                log.warning("dropped a malformed client message: %s", exc)
                continue
            if isinstance(msg, messages.AddRequest):
                service.on_add(client_id, msg)
            elif isinstance(msg, messages.Abort):
                service.on_abort(msg.request_ids)
            elif isinstance(msg, messages.UtilityCall):
                service.on_utility(client_id, msg)

    def _drain_events(self) -> None:
        while True:
            try:
                msg = ipc.recv(self.events, zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(msg, messages.StopMatched):
                self.service.on_stop_matched(msg)
            elif isinstance(msg, messages.Abort):
                self.service.on_abort(msg.request_ids)

    def shutdown(self) -> None:
        stop = ipc.encode(messages.Shutdown("scheduler stopped"))
        for rank in range(self.tp_size):
            try:
                self.workers.send_multipart([worker_identity(rank), *stop], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that rank is already gone
        try:
            ipc.send(self.detok, messages.Shutdown("scheduler stopped"), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        time.sleep(0.05)  # let the shutdown frames leave before the sockets close
        for sock in (self.frontend, self.workers, self.events, self.detok, self.control):
            sock.close(linger=200)
        self.ctx.term()
        if self.block_tables is not None:
            self.block_tables.close()
            self.block_tables.unlink()


def main() -> int:
    ns = role_arg_parser("pagedserve scheduler").parse_args()
    cfg = load_config(ns)
    die_with_parent()
    proc = SchedulerProcess(cfg)

    def on_term(signum, _frame):
        proc.stop_requested = True
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    code = 1
    try:
        code = proc.run()
        log.info("stop: drained")
    except SystemExit as exc:
        code = int(exc.code or 0)
    except Exception as exc:  # a fatal error: tell the launcher, then exit non-zero
        log.exception("fatal: %s", exc)
        try:
            ipc.send(proc.control, messages.ProcessFatal("scheduler", 0, os.getpid(), str(exc)))
        except zmq.ZMQError:
            pass
    finally:
        proc.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
