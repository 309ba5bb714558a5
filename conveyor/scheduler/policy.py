"""Scheduling policies: the order of the waiting queue, who joins a step, who gives way.

The scheduler owns every request and makes every change; a policy only answers its four
questions (the `Policy` methods), so a new policy is a small subclass (docs/SCHEDULING.md).
Built in: `fcfs` (the default), `priority`, `deadline` and `length-aware`; `make_policy` also
loads `module:Class`. Whatever the policy says, the scheduler's fairness guard puts a request that
waited longer than `max_wait_s` first and never preempts it for another.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

from conveyor.scheduler.request import Request


@dataclass(frozen=True)
class SchedulingContext:
    """What a policy may know about the engine when it answers."""
    now: float                               # time.time() of the step being planned
    step_time_s: float                       # recent wall time of one step; 0.0 before any
    token_budget: int                        # max_num_batched_tokens
    num_running: int                         # requests holding a slot as the step is planned


class Policy:
    """Override `order_waiting` and `pick_victim`; the other two have a neutral default."""
    # NOTE: a request's `priority` is refused (unless 0) where the policy would ignore it; a
    # policy of one's own may read it, so only the built-ins that do not say so.
    reads_priority = True

    def order_waiting(self, waiting: list[Request], ctx: SchedulingContext) -> list[Request]:
        """The waiting requests in the order they should be admitted (a new list).

        Preempted requests are in `waiting` too. The scheduler admits from the front and stops
        at the first request that does not fit (budget, sequence slots, KV blocks) and may not
        preempt its way in.
        """
        raise NotImplementedError

    def admit(self, req: Request, admitted: list[Request], ctx: SchedulingContext) -> bool:
        """Whether `req`, next in order, joins this step; `admitted` joined it before. False
        skips it for this step only: it keeps its place, and the next one is asked."""
        return True

    def may_preempt(self, waiting: Request, running: Request, ctx: SchedulingContext) -> bool:
        """Whether `waiting`, next in order but short of a slot or blocks, may take the place of
        `running` (which is then preempted and recomputed later)."""
        return False

    def pick_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt among `candidates` (never empty): when a running one
        needs blocks that are not there, or among those `may_preempt` allowed."""
        raise NotImplementedError


class FCFSPolicy(Policy):
    """First come, first served: by arrival; the latest arrival is preempted first."""
    reads_priority = False

    def order_waiting(self, waiting, ctx):
        return sorted(waiting, key=_arrival_key)

    def pick_victim(self, candidates):
        return max(candidates, key=_arrival_key)


class PriorityPolicy(Policy):
    """Lower `priority` first (vLLM's convention), then by arrival. A waiting request may take
    the place of a running one of strictly lower priority (a larger number), the lowest and
    latest first; never of equal priority, which would only trade places back and forth."""

    def order_waiting(self, waiting, ctx):
        return sorted(waiting, key=_priority_key)

    def may_preempt(self, waiting, running, ctx):
        return waiting.options.priority < running.options.priority

    def pick_victim(self, candidates):
        return max(candidates, key=_priority_key)


class DeadlinePolicy(Policy):
    """Earliest deadline first, with admission control.

    A request's deadline is when its next token is due under its latency objectives
    (`Request.due`). Requests whose deadline is still ahead and reachable go first, earliest
    first; reachable means the prompt tokens ahead of it and its own, at a step's token budget
    less one decode per running request, fit in the steps left at the recent step time. The rest
    (no objective, already late, or out of reach: serving those first would only make more
    requests late) follow by arrival. A request whose deadline is still ahead may preempt a
    running one that has no objective at stake.
    """
    reads_priority = False

    def order_waiting(self, waiting, ctx):
        urgent = sorted((r for r in waiting if _due_ahead(r, ctx.now)), key=_due_key)
        per_step = max(1, ctx.token_budget - ctx.num_running)
        on_time, ahead = [], 0
        for r in urgent:
            if ctx.now + math.ceil((ahead + r.num_tokens) / per_step) * ctx.step_time_s <= r.due():
                on_time.append(r)
                ahead += r.num_tokens
        chosen = set(on_time)
        return on_time + sorted((r for r in waiting if r not in chosen), key=_arrival_key)

    def may_preempt(self, waiting, running, ctx):
        return _due_ahead(waiting, ctx.now) and running.due() is None

    def pick_victim(self, candidates):
        # nothing at stake first (latest arrival), then the latest deadline
        return max(candidates, key=lambda r: (1, *_arrival_key(r)) if r.due() is None
                   else (0, r.due(), r.arrival_index))


class LengthAwarePolicy(Policy):
    """Short prompts first, and one length class per step.

    Waiting requests go by length class (tokens to compute, in powers of two), shortest first,
    then by arrival, so a long prompt cannot hold short ones up; the prompts admitted in one step
    share a class, so a step's prefill is made of similar lengths. A long prompt waits at most
    `max_wait_s` (the scheduler's fairness guard). The latest arrival is preempted first.
    """
    reads_priority = False

    def order_waiting(self, waiting, ctx):
        return sorted(waiting, key=lambda r: (_length_class(r), *_arrival_key(r)))

    def admit(self, req, admitted, ctx):
        return not admitted or _length_class(req) == _length_class(admitted[0])

    def pick_victim(self, candidates):
        return max(candidates, key=_arrival_key)


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy,
                                     "deadline": DeadlinePolicy, "length-aware": LengthAwarePolicy}


def make_policy(name: str) -> Policy:
    """A built-in policy by name, or `module:Class` (a Policy subclass built with no
    arguments); ValueError saying what is wrong otherwise."""
    if name in POLICIES:
        return POLICIES[name]()
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)} or "
                         f"module:Class, got {name!r}")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load scheduling policy {name!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"scheduling policy {name!r} is not a subclass of "
                         f"conveyor.scheduler.Policy")
    return cls()


def _arrival_key(req: Request) -> tuple[float, int]:
    return req.arrival, req.arrival_index


def _priority_key(req: Request) -> tuple[int, float, int]:
    return req.options.priority, req.arrival, req.arrival_index


def _due_key(req: Request) -> tuple[float, int]:
    return req.due(), req.arrival_index


def _due_ahead(req: Request, now: float) -> bool:
    due = req.due()
    return due is not None and due > now


def _length_class(req: Request) -> int:
    return (req.num_tokens - 1).bit_length()
