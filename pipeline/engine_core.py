"""EngineCore: the scheduler, one worker rank and the detokenizer, stepped in one process.

The same cores and services the processes run, exchanging the same messages through the same
dispatch tables - by function call instead of sockets. `submit` takes an AddRequest (and
`abort` an Abort) as the scheduler's frontend would; `step(now)` plans a step, executes the
plan on the WorkerCore, applies the result and lets the detokenizer turn the tokens into text;
whatever the roles would have sent a client comes back from `submit`/`step` as those messages
(DeltaBatch, RequestRejected, RequestFailed). Tensor parallel size 1 only.

Steps run through the scheduler process's StepLoop: with overlapped scheduling on
(`--async-scheduling`, the default) the step of steady decodes behind each step is planned
before its result is applied, and the worker takes that step's tokens from its own samples,
as the worker ranks of a process group do.

A debugger steps from `Scheduler.schedule()` through `ModelRunner.execute()` to the logits and
back; `LLM(..., in_process=True)` and the benchmarks that need no processes run on it.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from pagedserve import transport
from pagedserve.pipeline import messages
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.detokenizer.service import DetokenizerService
from pagedserve.pipeline.scheduler import Scheduler, SchedulerConfig
from pagedserve.pipeline.scheduler.service import SchedulerService
from pagedserve.pipeline.scheduler.step_loop import StepLoop

log = logging.getLogger("pagedserve.engine_core")

CLIENT_ID = b"in-process"


class EngineCore:
    def __init__(self, config: EngineConfig, worker, num_gpu_blocks: int, num_cpu_blocks: int,
                 tokenizer, *, clock=time.time) -> None:
        """`worker`: a WorkerCore of rank 0 (with a sampler) built for `config`."""
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("EngineCore runs one worker rank in this process: "
                             f"tensor_parallel_size must be 1, got "
                             f"{config.parallel.tensor_parallel_size}")
        self.config = config
        self.worker = worker
        self.scheduler = Scheduler.from_config(
            SchedulerConfig.from_engine(config), num_gpu_blocks, num_cpu_blocks,
            eos_token_ids=config.model_info.eos_token_ids)
        tiers = getattr(worker, "tiers", None)
        if tiers is not None:  # the KV tiers below the device pool, as the worker built them
            from pagedserve.kvmanager.tiers import build_tiers
            kv_tiers = build_tiers(0 if tiers.host is None else tiers.host.shape[2],
                                   tiers.block_nbytes, tiers.namespace if tiers.disk_dir else b"",
                                   config.cache.kv_offload_dir, config.cache.kv_offload_disk_size)
            if kv_tiers is not None:
                self.scheduler.kv.attach_tiers(kv_tiers)
        self._mail: deque[tuple[transport.Dispatcher | None, Any, bytes | None]] = deque()
        self._outbox: list[Any] = []
        from pagedserve.pipeline.structured.setup import enable_structured_outputs
        gate = enable_structured_outputs(
            self.scheduler, config.model_info,
            timeout_s=config.scheduling.grammar_compile_timeout)
        self.service = SchedulerService(
            self.scheduler, clock=clock, instance="in-process", grammar_gate=gate,
            send_to_client=lambda _client, msg: self._post(None, msg),
            send_to_detok=lambda msg: self._post(self._to_detokenizer, msg))
        self.detokenizer = DetokenizerService(
            tokenizer, send_to_client=lambda _client, msg: self._post(None, msg),
            send_to_scheduler=lambda msg: self._post(self._to_scheduler, msg))
        self._to_scheduler = transport.Dispatcher("scheduler", self.service.handlers(), log=log)
        self._to_detokenizer = transport.Dispatcher("detokenizer", self.detokenizer.handlers(),
                                                    log=log)
        self._sent: deque[messages.StepPlan] = deque()  # plans the worker has yet to run, in order
        self.loop = StepLoop(self.service, self._send_plan,
                             overlap=config.scheduling.async_scheduling)

    @classmethod
    def build(cls, config: EngineConfig) -> "EngineCore":
        """Resolve the model (if the config does not say yet), build the worker rank and the
        tokenizer, and the scheduler over the blocks the worker holds."""
        from pagedserve.pipeline.model_resolution import resolve_model
        from pagedserve.pipeline.tokenizer import load_tokenizer
        from pagedserve.workers.build import build_core
        if not config.model_info.resolved:
            resolve_model(config)
        worker, num_gpu_blocks, num_cpu_blocks = build_core(config, 0, shared_swap=False)
        return cls(config, worker, num_gpu_blocks, num_cpu_blocks,
                   load_tokenizer(config.model_info.tokenizer_dir,
                                  chat_template=config.model_info.chat_template))

    # -- the client's side ------------------------------------------------------------------
    def submit(self, request: messages.AddRequest) -> list[Any]:
        """Hand a request to the scheduler; returns what a client would receive at once (a
        RequestRejected for a request that can never run)."""
        self._post(self._to_scheduler, request, CLIENT_ID)
        return self._deliver()

    def abort(self, *request_ids: str) -> list[Any]:
        self._post(self._to_scheduler, messages.Abort(list(request_ids)), CLIENT_ID)
        return self._deliver()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.service.compiling

    def stats(self) -> dict:
        return self.service.stats()

    # -- the step ---------------------------------------------------------------------------
    def step(self, now: float | None = None) -> list[Any]:
        """One engine step: schedule, execute, update, detokenize. Returns the messages for
        the client (DeltaBatch, RequestFailed ...) in the order the roles sent them."""
        now = time.time() if now is None else now
        self.service.admit_compiled()
        if self.service.compiling and not self.scheduler.has_unfinished():
            time.sleep(0.002)  # only grammars compiling: nothing to step yet
            return self._deliver()
        if self.loop.ready():
            self.loop.start(now)
        if self._sent:
            self.loop.on_result(self.worker.execute(self._sent.popleft()))
        return self._deliver()

    def _send_plan(self, plan: messages.StepPlan) -> bool:
        self._sent.append(plan)
        return True

    def _post(self, to: transport.Dispatcher | None, msg: Any, sender: bytes | None = None
              ) -> None:
        self._mail.append((to, msg, sender))

    def _deliver(self) -> list[Any]:
        """Hand on every message posted so far, in order (a handler may post more)."""
        while self._mail:
            to, msg, sender = self._mail.popleft()
            if to is None:
                self._outbox.append(msg)
            else:
                to.dispatch(msg, sender)
        out, self._outbox = self._outbox, []
        return out
