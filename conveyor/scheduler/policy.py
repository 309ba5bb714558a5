"""Scheduling policies: which waiting request goes first, and which running one gives way.

The scheduler asks a policy two questions and nothing else, so priority, deadline or
length-bucketing policies plug in by subclassing `Policy`. FCFS is the default.
"""
from __future__ import annotations

from conveyor.scheduler.request import Request


class Policy:
    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        """The waiting requests in the order they should be admitted (a new list).

        Preempted requests are in `waiting` too; the scheduler admits from the front and stops
        at the first request that does not fit.
        """
        raise NotImplementedError

    def pick_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt when blocks run out; `candidates` is never empty."""
        raise NotImplementedError


class FCFSPolicy(Policy):
    """First come, first served: by arrival time; the latest arrival is preempted first."""

    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        return sorted(waiting, key=_arrival_key)

    def pick_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=_arrival_key)


def _arrival_key(req: Request) -> tuple[float, int]:
    return req.arrival, req.arrival_index
