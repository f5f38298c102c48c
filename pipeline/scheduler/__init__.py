"""The scheduling policy (pure code: no sockets, the clock passed in)."""
from pagedserve.pipeline.scheduler.admission import QueueFull, RequestRejected
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.scheduler import Scheduler
from pagedserve.pipeline.scheduler.step_outputs import Recovery, SchedulerStats

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "Recovery", "RequestRejected",
           "QueueFull"]
