"""The scheduling policy (pure code: no sockets, the clock passed in)."""
from pipeline.scheduler.admission import QueueFull, RequestRejected
from pipeline.scheduler.config import SchedulerConfig
from pipeline.scheduler.policy import FCFSPolicy, PriorityPolicy, make_policy
from pipeline.scheduler.preemption import PreemptionChooser, PreemptionCostModel
from pipeline.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "RequestRejected", "QueueFull",
           "FCFSPolicy", "PriorityPolicy", "make_policy", "PreemptionChooser",
           "PreemptionCostModel"]
