"""Scheduler role: `python -m pagedserve.pipeline.scheduler.process --config-file ...`.

Its sockets and the worker group's epochs are docs/INTERFACES.md's "The process protocol". While
the workers compute a step the loop keeps taking messages; the next plan is built the moment
the result arrives. With nothing to do it blocks on its sockets (waking once a second).
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import time
import uuid
from collections import Counter

import zmq

from pagedserve import cluster_auth, transport
from pagedserve.faults import FaultInjector
from pagedserve.lifecycle import SignalWakeup, start_role
from pagedserve.pipeline import messages
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.scheduler import Scheduler, SchedulerConfig
from pagedserve.pipeline.scheduler.service import SchedulerService
from pagedserve.pipeline.scheduler.step_loop import StepLoop

log = logging.getLogger("pagedserve.scheduler")
IDLE_POLL_MS = 1000
COMPILE_POLL_MS = 2  # while a request waits for its grammar to compile
# Idle time (since ready or the last work) after which the grammar tables are built ahead of
# use: long enough that a client starting at health (a benchmark, a test) has begun.
WARM_AFTER_IDLE_S = 10.0
RESET_RETRY_S = 0.5
DETOK_HWM = 1024  # TokenBatches queued for a slow detokenizer before the scheduler waits


class SchedulerProcess:
    def __init__(self, cfg: EngineConfig, faults: FaultInjector, incarnation: int = 0):
        self.cfg = cfg
        self.tp_size = cfg.parallel.tensor_parallel_size
        self.step_timeout = cfg.scheduling.step_timeout
        self.grammars_warmed = False  # see _warm_grammars_when_idle
        self.busy_at = time.monotonic()
        self.trace = open(cfg.env.step_trace, "a", encoding="utf-8") if cfg.env.step_trace else None
        self.instance = uuid.uuid4().hex[:12]
        self.epoch = 0
        self.faults = faults
        self.incarnation = incarnation
        self.ctx = zmq.Context()
        self.frontend = transport.make_socket(self.ctx, zmq.ROUTER, cfg.ipc.frontend_addr,
                                              bind=True, hwm=transport.CLIENT_HWM)
        self.workers = transport.make_socket(
            self.ctx, zmq.ROUTER, cfg.ipc.plan_addr, bind=True,
            secure=cluster_auth.for_address(cfg.ipc.plan_addr, cfg.cluster.cluster_secret_file,
                                            server=True))
        if cfg.ipc.plan_addr.startswith("tcp://"):  # worker ranks on other hosts
            cluster_auth.log_refusals(self.workers, cfg.ipc.plan_addr, log)
        self.events = transport.make_socket(self.ctx, zmq.PULL, cfg.ipc.events_addr, bind=True)
        self.detok = transport.make_socket(self.ctx, zmq.PUSH, cfg.ipc.detok_addr, bind=False)
        self.detok.setsockopt(zmq.SNDHWM, DETOK_HWM)  # backpressure, bounded memory
        self.control = transport.make_socket(self.ctx, zmq.PUSH, cfg.ipc.control_addr, bind=False)
        self.block_tables = None
        self.service: SchedulerService | None = None
        self.loop: StepLoop | None = None  # built with the service
        self.trace_since: float | None = None  # step trace: see _on_step_result
        self.ready_ranks: dict[int, messages.WorkerReady] = {}
        self.last_reset_sent = 0.0
        self.stop_requested = False
        # Messages no handler took, by (role, tag), from the start: the service's once built.
        self.unknown_messages: Counter[tuple[str, str]] = Counter()
        # One table for all three sockets, the service's messages added once it is built; the
        # sender is the identity on the ROUTERs and None on the PULL (detokenizer, launcher).
        self.dispatcher = transport.Dispatcher(
            "scheduler", self._group_handlers(), log=log,
            report=lambda tag, _reason: self._count_unknown("scheduler", tag))

    @property
    def token(self) -> str:
        return f"{self.instance}:{self.epoch}"

    @property
    def inflight(self) -> messages.StepPlan | None:
        return None if self.loop is None else self.loop.inflight

    @property
    def workers_ready(self) -> bool:
        return len(self.ready_ranks) == self.tp_size

    def _send_to_ranks(self, msg, ranks) -> None:
        """Without waiting: a rank not connected (yet, or any more) misses it."""
        for rank in ranks:
            with contextlib.suppress(zmq.ZMQError):
                transport.send(self.workers, msg, f"worker{rank}".encode(), flags=zmq.NOBLOCK)

    def _send_resets(self) -> None:  # resent until every rank is ready
        self._send_to_ranks(messages.Reset(self.token),
                            [rank for rank in range(self.tp_size) if rank not in self.ready_ranks])
        self.last_reset_sent = time.monotonic()

    def lose_workers(self, why: str, attributable: bool = False) -> None:
        """The workers' KV state is gone: recompute everything on a fresh (reset) group.
        `attributable`: the loss may have been caused by the step in flight (a rank raised or
        crashed), which counts against its requests (Scheduler.reset_device_state)."""
        self.epoch += 1
        self.ready_ranks.clear()
        self.trace_since = None
        if self.service is not None:
            scheduler = self.service.scheduler
            recovery = scheduler.reset_device_state(why, attributable)
            self.service.roles_down.setdefault("worker", why)
            log.info("worker group lost (%s): %d sequence(s) will be recomputed, %d stay "
                     "swapped out in the host pool", why, recovery.recomputed,
                     scheduler.num_swapped)
            for request_id, message in recovery.failed:
                log.error("%s", message)
            self.service.fail_requests(recovery.failed)
        self._send_resets()

    def _on_worker_ready(self, msg: messages.WorkerReady, _peer=None) -> None:
        if msg.token != self.token:
            # A rank that (re)started, or an answer to an older Reset: ask it to join this epoch.
            self.ready_ranks.pop(msg.rank, None)
            self._send_resets()
            return
        if msg.rank in self.ready_ranks:
            return  # an answer to a resent Reset
        self.ready_ranks[msg.rank] = msg
        if self.workers_ready and self.service is not None:
            self.service.roles_down.pop("worker", None)
            log.info("worker group ready (epoch %d)", self.epoch)

    def wait_for_workers(self) -> tuple[int, int]:
        self._send_resets()
        while not self.workers_ready:
            if self.stop_requested:
                raise SystemExit(0)
            if self.workers.poll(int(RESET_RETRY_S * 1000)):
                self._drain(self.workers, routed=True)
            if time.monotonic() - self.last_reset_sent > RESET_RETRY_S:
                self._send_resets()
        ready = self.ready_ranks.values()
        return min(r.num_gpu_blocks for r in ready), min(r.num_cpu_blocks for r in ready)

    def build(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        from pagedserve.kvmanager import SharedBlockTables
        sconf = SchedulerConfig.from_engine(self.cfg)
        max_blocks = -(-self.cfg.max_model_len // sconf.block_size)
        segment = self.cfg.ipc.block_tables_segment
        with contextlib.suppress(FileNotFoundError):  # a killed predecessor could not unlink it
            os.unlink(os.path.join("/dev/shm", segment))
        # A row per sequence holding blocks: running ones plus swapped ones (>= 1 host block each).
        # Workers on other hosts cannot map this host's shared memory: plans carry the tables.
        self.block_tables = None if self.cfg.cluster.nnodes > 1 else SharedBlockTables(
            sconf.max_num_seqs + num_cpu_blocks, max_blocks, name=segment)
        scheduler = Scheduler.from_config(sconf, num_gpu_blocks, num_cpu_blocks,
                                          eos_token_ids=self.cfg.model_info.eos_token_ids,
                                          block_tables=self.block_tables)
        # The KV tiers below the device pool, as the workers built them (kvmanager/tiers.py).
        from pagedserve.kvmanager.tiers import build_tiers
        ready, c = list(self.ready_ranks.values()), self.cfg.cache
        tiers = build_tiers(min(r.num_tier_blocks for r in ready), ready[0].block_bytes,
                            ready[0].tier_namespace, c.kv_offload_dir, c.kv_offload_disk_size)
        if tiers is not None:
            scheduler.kv.attach_tiers(tiers)
            log.info("KV tiers: %d host blocks, disk %s (%d blocks found there)",
                     tiers.host.pool.num_blocks if tiers.host else 0,
                     tiers.disk.directory if tiers.disk else "off",
                     len(tiers.disk.index) if tiers.disk else 0)
        from pagedserve.pipeline.structured.setup import enable_structured_outputs
        gate = enable_structured_outputs(  # warmed when idle
            scheduler, self.cfg.model_info,
            timeout_s=self.cfg.scheduling.grammar_compile_timeout)
        self.service = SchedulerService(
            scheduler, instance=self.instance, grammar_gate=gate,
            retain_finished_s=self.cfg.supervisor.heartbeat_timeout + 10.0,
            send_to_client=lambda cid, msg: transport.send_to_peer(self.frontend, msg, cid),
            send_to_detok=self._send_to_detok)
        self.service.unknown_messages = self.unknown_messages
        if self.incarnation:
            self.service.restarts["scheduler"] = self.incarnation
        self.loop = StepLoop(self.service, self._send_plan,
                             overlap=self.cfg.scheduling.async_scheduling,
                             step_timeout=self.step_timeout,
                             on_planned=lambda plan: self.faults.on_message(step=plan.step_id))
        self.dispatcher.handlers = {**self.service.handlers(), **self._group_handlers()}
        log.info("KV cache: %d device blocks, %d host blocks of %d tokens; max model len %d",
                 num_gpu_blocks, num_cpu_blocks, sconf.block_size, self.cfg.max_model_len)

    def run(self) -> int:
        # Whatever the detokenizer holds belongs to a previous scheduler (if any).
        transport.send(self.detok, messages.Reset(self.instance))
        num_gpu, num_cpu = self.wait_for_workers()
        self.build(num_gpu, num_cpu)
        # What start-up built lives as long as the process: keep it out of the GC's scans.
        gc.collect()
        gc.freeze()
        transport.send(self.control, messages.ProcessReady("scheduler", 0, os.getpid(),
                                                     f"{num_gpu} KV blocks"))
        self.busy_at = time.monotonic()  # the idle clock starts at ready
        self.faults.started()
        poller = zmq.Poller()
        for sock in (self.frontend, self.workers, self.events):
            poller.register(sock, zmq.POLLIN)
        wakeup = SignalWakeup()  # a SIGTERM ends the idle poll at once
        poller.register(wakeup.fileno(), zmq.POLLIN)  # the poller reports it by this fd
        service = self.service
        last_liveness = time.monotonic()
        while True:
            if self.stop_requested and not service.draining:
                service.draining = True
                log.info("draining: %d request(s) in flight", len(service.scheduler.requests))
            if service.draining and self.inflight is None and not service.scheduler.has_unfinished():
                return 0
            busy = self.workers_ready and self.loop.ready()
            timeout = 0 if busy else (int(RESET_RETRY_S * 1000) if not self.workers_ready
                                      else COMPILE_POLL_MS if service.compiling else IDLE_POLL_MS)
            events = dict(poller.poll(timeout))
            if wakeup.fileno() in events:
                wakeup.drain()
            for sock in (self.workers, self.frontend, self.events):
                if sock in events:
                    self._drain(sock, routed=sock is not self.events)
            service.admit_compiled()  # requests whose grammar is ready join the queue
            now = time.monotonic()
            if not self.workers_ready and now - self.last_reset_sent > RESET_RETRY_S:
                self._send_resets()
            hung = self.loop.overdue(now)
            if hung is not None:
                log.error("step %d has run %.1fs, past --step-timeout %.1fs: the worker group "
                          "is hung", hung.step_id, now - self.loop.inflight_since, self.step_timeout)
                transport.send(self.control, messages.StepTimeout(hung.step_id, self.step_timeout))
                self.lose_workers(f"step {hung.step_id} timed out")
            if now - last_liveness >= 1.0:
                service.abort_silent_clients()
                transport.send(self.control, messages.Heartbeat("scheduler", os.getpid()))
                last_liveness = now
                self._warm_grammars_when_idle(now)
            if self.workers_ready and self.loop.ready():
                self.loop.start(time.time())

    def _warm_grammars_when_idle(self, now: float) -> None:
        """Build the vocabulary's grammar tables once nothing has run for WARM_AFTER_IDLE_S (a
        structured request that comes first builds them itself). Built beside running steps
        (xgrammar imports torch), they made the first batch after a start ~4x slower."""
        if self.grammars_warmed or self.service.grammar_gate is None:
            return
        if self.inflight is not None or self.service.scheduler.has_unfinished():
            self.busy_at = now
        elif now - self.busy_at >= WARM_AFTER_IDLE_S:
            self.service.grammar_gate.compiler.warm()
            self.grammars_warmed = True

    def _send_plan(self, plan: messages.StepPlan) -> bool:
        frames = transport.encode(plan)
        try:
            for rank in range(self.tp_size):
                self.workers.send_multipart([f"worker{rank}".encode(), *frames], copy=False)
        except zmq.ZMQError as exc:  # a rank vanished between its last answer and now
            # The plan stays in flight: recovery reads it (its swap-outs may not have happened).
            self.lose_workers(f"cannot reach a worker rank: {exc}")
            return False
        return True

    def _send_to_detok(self, msg) -> None:
        if self.trace is not None and isinstance(msg, messages.TokenBatch):
            msg.sent = time.monotonic()
        transport.send(self.detok, msg)

    def _trace_step(self, plan: messages.StepPlan, timings: dict, schedule_ms: float,
                    since: float, received: float, updated: float) -> None:
        """One JSON line per step (PAGEDSERVE_STEP_TRACE=<file>): its mix and where its time
        went: schedule, send (until rank 0 has the plan), rank 0's forward and sample, return
        (result sent until here), update. A step planned ahead counts from rank 0's sending the
        result before. Clock readings are time.monotonic(): one host's clock."""
        decodes = len(plan.decode_seq_ids) + sum(1 for s in plan.scheduled if s.num_tokens == 1)
        line = {"role": "scheduler", "step": plan.step_id, "decode_seqs": decodes,
                "prefill_tokens": plan.num_tokens - decodes,
                "prefill_seqs": plan.num_scheduled - decodes,
                "ahead": plan.ahead, "schedule_ms": schedule_ms,
                "round_trip_ms": (received - since) * 1e3,
                "update_ms": (updated - received) * 1e3,
                "waiting": len(self.service.scheduler.queues.waiting)}
        if timings:
            line |= {"send_ms": (timings["received"] - since) * 1e3,
                     "return_ms": (received - timings["sent"]) * 1e3,
                     "other_ms": timings["forward_ms"] - timings["matmul_ms"]
                     - timings["attention_ms"],
                     **{k: v for k, v in timings.items() if k.endswith("_ms")}}
        self.trace.write(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                     for k, v in line.items()}) + "\n")
        self.trace.flush()

    def _drain(self, sock: zmq.Socket, routed: bool) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.dispatcher.receive(frames, routed=routed, with_sender=True)

    def _count_unknown(self, role: str, tag: str) -> None:
        self.unknown_messages[role, tag] += 1

    # -- the worker group's messages (the rest are SchedulerService.handlers) -----------------
    def _group_handlers(self) -> dict:
        return {messages.StepResult: self._on_step_result,
                messages.WorkerReady: self._on_worker_ready,
                messages.WorkerFailed: self._on_worker_failed,
                messages.RoleDown: self._on_role_down,
                messages.UnknownMessage:
                    lambda msg, _peer: self._count_unknown(msg.role, msg.tag)}

    def _on_step_result(self, msg: messages.StepResult, _peer) -> None:
        if self.loop is None:
            return  # before the scheduler was built: nothing was sent
        received = time.monotonic()
        since = self.loop.inflight_since if self.trace_since is None else self.trace_since
        schedule_ms = self.loop.schedule_ms
        plan = self.loop.on_result(msg)  # None: a result from before a reset, ignored
        if plan is None or self.trace is None:
            return
        self._trace_step(plan, msg.timings, schedule_ms, since, received, self.loop.applied_at)
        # A step planned ahead is in flight now: it started when rank 0 sent this result (it
        # had the plan by then); None: a step counts from when it is sent.
        self.trace_since = msg.timings.get("sent") if self.inflight is not None else None

    def _on_worker_failed(self, msg: messages.WorkerFailed, _peer) -> None:
        if self.inflight is not None or self.workers_ready:
            self.lose_workers(f"rank {msg.rank} failed at step {msg.step_id}: {msg.message}",
                              attributable=True)

    def _on_role_down(self, msg: messages.RoleDown, _peer) -> None:
        log.info("%s is down (%s); restarting", msg.role, msg.cause)
        self.service.count_restart(msg.role)
        if msg.role.startswith("worker"):
            self.lose_workers(msg.cause, msg.attributable)
        else:
            self.service.roles_down[msg.role] = msg.cause
            if msg.role == "detokenizer" and msg.suspect:
                self.service.quarantine(msg.suspect, msg.cause)

    def shutdown(self) -> None:
        self._send_to_ranks(messages.Shutdown("scheduler stopped"), range(self.tp_size))
        with contextlib.suppress(zmq.ZMQError):
            transport.send(self.detok, messages.Shutdown("scheduler stopped"), flags=zmq.NOBLOCK)
        time.sleep(0.05)  # let the shutdown frames leave before the sockets close
        for sock in (self.frontend, self.workers, self.events, self.detok, self.control):
            sock.close(linger=200)
        cluster_auth.stop_allow_list(self.ctx)   # its ZAP socket would hold term() forever
        self.ctx.term()
        if self.block_tables is not None:
            self.block_tables.close()


def main() -> int:
    role = start_role("scheduler", "pagedserve scheduler")
    proc = SchedulerProcess(role.config, role.faults, role.incarnation)

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
        with contextlib.suppress(zmq.ZMQError):
            transport.send(proc.control, messages.ProcessFatal("scheduler", 0, os.getpid(),
                                                               f"{type(exc).__name__}: {exc}"))
    finally:
        proc.shutdown()
    return code


if __name__ == "__main__":
    from pagedserve.lifecycle import exit_role
    exit_role(main())
