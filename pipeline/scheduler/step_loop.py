"""The steps with the workers, driven alike by SchedulerProcess and EngineCore; no sockets, no
clock of its own (docs/INTERFACES.md, `StepLoop`; docs/ARCHITECTURE.md, "Overlapped scheduling")."""
from __future__ import annotations

import time
from typing import Callable

from pagedserve.pipeline.messages import StepPlan, StepResult


class StepLoop:
    def __init__(self, service, send: Callable[[StepPlan], bool], *, overlap: bool,
                 step_timeout: float = float("inf"), clock: Callable[[], float] = time.monotonic,
                 on_planned: Callable[[StepPlan], None] | None = None) -> None:
        self.service = service
        self.scheduler = service.scheduler
        self._send = send
        self.overlap = overlap
        self.step_timeout = step_timeout
        self.clock = clock
        self._on_planned = on_planned or (lambda plan: None)
        self.inflight_since = 0.0   # clock() when the step in flight was sent (or promoted)
        self.schedule_ms = 0.0      # what planning the step in flight cost
        self.applied_at = 0.0       # clock() when the last result was applied
        self._ahead_schedule_ms = 0.0

    @property
    def inflight(self) -> StepPlan | None:
        return self.scheduler.step_in_flight

    def ready(self) -> bool:
        """A step can be started: none in flight, and a request to plan for."""
        return self.inflight is None and self.scheduler.has_unfinished()

    def start(self, now: float) -> StepPlan | None:
        """Plan a step at wall time `now` and send it, then the step behind it when it can be
        planned ahead. None: nothing could run, or the workers could not be reached."""
        if self.inflight is not None:
            raise RuntimeError(f"step {self.inflight.step_id} is still in flight")
        started = time.perf_counter()
        plan = self.scheduler.schedule(now)
        self.schedule_ms = (time.perf_counter() - started) * 1e3
        self._on_planned(plan)
        if not (plan.decode_seq_ids or plan.scheduled or plan.new_seqs or plan.swap_out
                or plan.swap_in or plan.copy or plan.forks or plan.finished_seq_ids):
            # nothing for the workers (e.g. every request waits for blocks an abort will free)
            self.scheduler.update(plan, StepResult(plan.step_id, [], [], None, None), now)
            return None
        sending = self.clock()
        if not self._send(plan):
            return None
        self.inflight_since = sending
        self._plan_ahead()
        return plan

    def on_result(self, result: StepResult) -> StepPlan | None:
        """Apply the result of the step in flight; the step planned ahead (already with the
        workers) is in flight from now on, and the one behind it is planned. Returns the plan
        applied; None for a result of a step no longer in flight (sent before a reset)."""
        plan = self.inflight
        if plan is None or plan.step_id != result.step_id:
            return None
        self.service.on_step_result(plan, result)  # Scheduler.update promotes the step ahead
        self.applied_at = self.clock()
        if self.inflight is not None:
            self.inflight_since = self.applied_at
            self.schedule_ms = self._ahead_schedule_ms
            self._plan_ahead()
        return plan

    def overdue(self, now: float) -> StepPlan | None:
        """The step in flight when it has run past the step timeout at clock() `now`."""
        plan = self.inflight
        return plan if plan is not None and now - self.inflight_since > self.step_timeout else None

    def _plan_ahead(self) -> None:
        if not self.overlap:  # (schedule_ahead plans nothing while a step ahead is out)
            return
        started = time.perf_counter()
        plan = self.scheduler.schedule_ahead()
        if plan is None:
            return
        self._ahead_schedule_ms = (time.perf_counter() - started) * 1e3
        self._on_planned(plan)
        self._send(plan)  # False: the workers were lost, and the step ahead with them
