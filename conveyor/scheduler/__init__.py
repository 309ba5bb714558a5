"""The scheduler's core: requests, KV blocks and the prefix cache, policies, step planning.

Pure Python with no torch, so it is tested in milliseconds without a model.
"""
from conveyor.scheduler.block_manager import BlockManager, IntegrityError
from conveyor.scheduler.policy import (
    DeadlinePolicy,
    FCFSPolicy,
    LengthAwarePolicy,
    Policy,
    PriorityPolicy,
    SchedulingContext,
    make_policy,
)
from conveyor.scheduler.request import Request, RequestStatus
from conveyor.scheduler.scheduler import Scheduler

__all__ = ["BlockManager", "DeadlinePolicy", "FCFSPolicy", "IntegrityError", "LengthAwarePolicy",
           "Policy", "PriorityPolicy", "Request", "RequestStatus", "Scheduler", "SchedulingContext",
           "make_policy"]
