"""A worker rank's messages, without sockets: StepPlan in -> WorkerCore -> StepResult out (rank
0), Reset -> a fresh sequence state and WorkerReady, Shutdown -> stop."""
from __future__ import annotations

import time
from collections.abc import Callable

from pagedserve.faults import FaultInjector
from pagedserve.pipeline import messages
from pagedserve.workers.core import WorkerCore


class WorkerStopped(Exception):
    """The scheduler said Shutdown."""


class WorkerService:
    def __init__(self, core: WorkerCore, rank: int, pid: int, num_gpu_blocks: int,
                 num_cpu_blocks: int, send_to_scheduler: Callable[[object], None],
                 faults: FaultInjector | None = None) -> None:
        self.core = core
        self.rank, self.pid = rank, pid
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.send_to_scheduler = send_to_scheduler
        self.faults = faults
        self.step_id = -1  # the last plan started: named in a failure report
        self.applied_token: str | None = None

    def ready(self, token: str = "") -> messages.WorkerReady:
        tiers = self.core.tiers
        if tiers is None:
            return messages.WorkerReady(self.rank, self.pid, self.num_gpu_blocks,
                                        self.num_cpu_blocks, token)
        return messages.WorkerReady(
            self.rank, self.pid, self.num_gpu_blocks, self.num_cpu_blocks, token,
            num_tier_blocks=0 if tiers.host is None else tiers.host.shape[2],
            block_bytes=tiers.block_nbytes,
            tier_namespace=tiers.namespace if tiers.disk_dir else b"")

    def on_plan(self, plan: messages.StepPlan) -> None:
        received = time.monotonic()
        self.step_id = plan.step_id
        if self.faults:
            tokens = {t for new in plan.new_seqs for t in new.prompt_token_ids} \
                if self.faults.wants_tokens else ()
            self.faults.on_message(step=plan.step_id, token_ids=tokens)
        result = self.core.execute(plan)
        if result is not None:
            if self.core.profiler is not None:  # PAGEDSERVE_STEP_TRACE
                result.timings["received"] = received
                result.timings["sent"] = time.monotonic()
            self.send_to_scheduler(result)

    def on_reset(self, msg: messages.Reset) -> None:
        if msg.token != self.applied_token:  # resent until answered: apply once
            self.core.reset()
            self.applied_token = msg.token
        self.send_to_scheduler(self.ready(msg.token))

    def on_shutdown(self, msg: messages.Shutdown) -> None:
        if self.core.tiers is not None:
            self.core.tiers.close()  # the disk tier's queued writes, for the next start
        raise WorkerStopped(msg.reason or "shutdown")

    def handlers(self) -> dict[type, Callable]:
        return {messages.StepPlan: self.on_plan, messages.Reset: self.on_reset,
                messages.Shutdown: self.on_shutdown}
