"""Step planning: continuous batching of prefill chunks and decodes under a token budget.

The scheduler owns every live request. `schedule()` plans the next step (running requests first,
then waiting ones in policy order, preempting by recompute when blocks run out); `update()` applies
the worker's result and says what the frontends should see. A worker applies a `StepPlan` in this
order: release the `freed` slots, install the `new` sequences, run `seqs`.

Admission of waiting requests (docs/SCHEDULING.md): in the policy's order, behind the fairness
guard, preempting running requests the policy lets a request take the place of; admit.py's.
What a request may not ask, and the bookkeeping's integrity check, are checks.py's; applying a
result, results.py's.

Overlap scheduling (`async_scheduling`): up to two plans are in flight, and step N+1 is planned
while step N runs, as if N were done. Planning a step advances its requests' progress at once; a
token it samples is pending (known to exist, value unknown) until update() of its step, and the
decode of the next plan computes it (the worker takes it from its device). Results are applied in
plan order. A stop by EOS or a stop token is seen one step late: the token already planned after
it is dropped.

Speculative decoding (`speculative_config`; docs/SPECULATIVE.md): a result carries the worker's
guesses of each sampled sequence's next tokens; the next plan verifies those that fit (the token
budget, max_tokens, the context, free blocks) as a step of 1 + guesses tokens, and its result
says how many were accepted: the request's progress goes back past the rejected ones, its blocks
past them are freed and never enter the prefix cache. The plan after a verification needs its
count, so a plan that verifies is alone in flight, and so is one asking a draft model for
guesses; n-gram guesses are looked up with the next plan in flight, and those after a token
still being drawn skip the first. Which plans verify or ask, and how a request whose guesses
do not pay backs off, is speculation.py's.

Pipeline parallel (`pipeline_parallel_size` P > 1): up to P plans (micro-batches) are in flight,
one in each stage, and no request is in two of them at once while it samples: a request whose
drawn token is pending is not planned again until its result is in, since the first stage needs
that token and only the last one has it (the next SeqStep carries it: `token_ids`). So the
running requests fall into micro-batches of about a P-th of them each (`_micro_batch_cap`),
which take turns through the stages.
"""
from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.scheduler import prompt_logprobs
from conveyor.scheduler.admission import Admission
from conveyor.scheduler.admit import AdmitWaiting
from conveyor.scheduler.block_manager import BlockManager
from conveyor.scheduler.checks import Checks
from conveyor.scheduler.mask_counts import MaskCounts
from conveyor.scheduler.objectives import ObjectiveCounts
from conveyor.scheduler.policy import Policy, make_policy
from conveyor.scheduler.request import Request, RequestStatus
from conveyor.scheduler.results import ApplyResults
from conveyor.scheduler.slots import SlotPool
from conveyor.scheduler.spec_counts import SpecCounts
from conveyor.scheduler.speculation import Asking, fitting_guesses
from conveyor.shared.config import EngineConfig
from conveyor.shared.messages.engine import AddRequest, Stats, TokenOutput
from conveyor.shared.messages.worker import NewSeq, SeqStep, StepPlan

# NOTE: a waiting request is admitted only if this share of the pool stays free afterwards (or
# the running requests' expected growth, if more: admission.py), unless nothing is running, so
# admitting it does not at once preempt the running decodes.
WATERMARK = 0.01

WAITING, RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING


@dataclass(slots=True)
class _Planned:
    """One request's part of a plan in flight."""
    req: Request
    step: SeqStep
    end: int                                 # the step computes tokens [end - num_tokens, end)
    incarnation: int                         # req.stats.num_preemptions when it was planned


class Scheduler(AdmitWaiting, ApplyResults, Checks):
    """derive_queue_cap: cap the waiting queue from the pool (`conveyor serve`; admission.py).
    clock: time.time, or a fake one in tests."""

    def __init__(self, config: EngineConfig, num_blocks: int, eos_token_ids: tuple[int, ...],
                 max_model_len: int, policy: Policy | None = None, derive_queue_cap: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        self.config = config
        self.policy = policy or make_policy(config.scheduling_policy)
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        # NOTE: no request outgrows the pool: it ends with "length" where the pool would overflow.
        self.max_len = min(max_model_len, num_blocks * config.block_size)
        key = os.urandom(32) if config.prefix_caching_hash_algo == "sha256-keyed" else None
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                   hash_key=key)
        self._watermark = int(WATERMARK * num_blocks)
        self.admission = Admission(num_blocks, config.block_size, config.max_num_seqs,
                                   self.max_len, config.max_queued_requests, derive_queue_cap)
        self.objectives = ObjectiveCounts()
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.slots = SlotPool(config.max_num_seqs)
        self.pp = config.pipeline_parallel_size
        self.max_in_flight = self.pp if self.pp > 1 else 2 if config.async_scheduling else 1
        self.spec = config.speculative
        self.spec_counts = SpecCounts()
        self.mask_counts = MaskCounts()
        # the step of the plan in flight that verifies, or asks a draft model for guesses (0:
        # none): the next plan waits for its result
        self._solo_step = 0
        self.asking = Asking(self.spec is not None and self.spec.overlapped)
        # (step, its parts, when it was planned), oldest first
        self._in_flight: deque[tuple[int, list[_Planned], float]] = deque()
        self._step = 0
        self.step_time_s = 0.0                # moving average of a step's wall time
        self._last_result = 0.0               # when update() last applied a result
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_prompt_tokens = 0            # prompt tokens computed (prefix-cache hits not)
        self.num_generated_tokens = 0
        self._integrity_ok = True
        self._last_audit = float("-inf")      # when audit() last ran check_integrity()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_in_flight(self) -> int:
        """Plans whose results are not applied yet."""
        return len(self._in_flight)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_schedule(self) -> bool:
        """Whether a schedule() call is due: work left, and room for one more plan in flight."""
        return self.has_work() and len(self._in_flight) < self._max_in_flight()

    def _speculating(self) -> bool:
        """Whether speculation is on at this batch size."""
        return self.spec is not None and self.spec.speculates(len(self.running))

    def _verifying(self) -> bool:
        """Whether the next plan verifies the guesses at hand: n-gram guesses where they have
        been paying for the batch (speculation.py); a draft model's guesses come only when a
        plan asked for them, and are verified."""
        return self._speculating() and (not self.spec.overlapped
                                        or self.asking.due(self.running))

    def _proposing(self) -> bool:
        """Whether the next plan asks for guesses: every plan for n-gram lookups while
        speculating; for a draft model (whose plan then runs alone) while its guesses have
        been paying (speculation.py)."""
        return self._speculating() and (self.spec.overlapped or self.asking.due(self.running))

    def _max_in_flight(self) -> int:
        if self._solo_step:
            return 0
        # NOTE: a draft model's guesses need the tokens of the plan that asks for them
        return 1 if self._proposing() and not self.spec.overlapped else self.max_in_flight

    def add(self, msg: AddRequest) -> list[TokenOutput]:
        """Queue a request; one that can never run ends at once with finish_reason "error"."""
        error = self._reject_reason(msg)
        if error is not None:
            return [TokenOutput(msg.id, [], finish_reason="error", error=error, error_code=400)]
        cap = self.admission.queue_cap()
        # NOTE: requests that free sequence slots will take at the next step are not queued
        if cap is not None and len(self.waiting) - self.slots.num_free >= cap:
            return [TokenOutput(msg.id, [], finish_reason="error", error_code=429,
                                error=f"the server is overloaded: {cap} requests are waiting")]
        req = Request.from_message(msg, next(self._arrivals))
        self.requests[req.id] = req
        self.waiting.append(req)
        self.admission.prompt_len.add(req.prompt_len)
        return []

    def abort(self, ids: list[str], reason: str = "abort") -> list[TokenOutput]:
        """End requests early ("stop" for a stop string the frontend matched); unknown ids are
        ignored, so a request ends exactly once."""
        outputs = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.finish_reason = "stop" if reason == "stop" else "abort"
            (self.running if req.status is RUNNING else self.waiting).remove(req)
            self._release(req)
            outputs.append(TokenOutput(req.id, [], finish_reason=req.finish_reason,
                                       stats=req.stats))
        return outputs

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when nothing can run now (with plans in flight, maybe
        after the next update())."""
        if len(self._in_flight) >= self._max_in_flight():
            raise RuntimeError(f"schedule() called with {len(self._in_flight)} plans in flight; "
                               f"update() first")
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        batch: list[_Planned] = []
        cap = self._micro_batch_cap() if self.pp > 1 else None    # sequences in this plan
        budget, preempted = self._schedule_running(batch, budget, now, self._verifying(), cap)
        new: list[NewSeq] = []
        # NOTE: after a preemption nothing new is admitted this step, lest it is preempted next.
        if not preempted or not batch:
            self._admit_waiting(batch, new, budget, now, cap)
        if not batch:
            return None
        # NOTE: single-token steps (decodes) come first: workers rely on this order.
        batch.sort(key=lambda p: p.step.num_tokens > 1)
        self._step += 1
        self._in_flight.append((self._step, batch, now))
        # NOTE: asks for guesses if the requests it leaves running speculate (and, for a draft
        # model, one is due)
        propose = self._proposing()
        verifies = any(p.step.draft_token_ids for p in batch)
        if self.spec is not None:
            self.asking.planned(verifies if self.spec.overlapped else propose, self.running)
        if verifies or (propose and not self.spec.overlapped):
            self._solo_step = self._step
        return StepPlan(self._step, new, [p.step for p in batch], self.slots.take_released(),
                        propose)

    def stats(self) -> Stats:
        """Counters for metrics; integrity_ok is the outcome of the last check_integrity()."""
        now, o = self.clock(), self.objectives
        return Stats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_free_blocks=self.blocks.num_free_blocks, num_total_blocks=self.blocks.num_blocks,
            num_cached_blocks=self.blocks.num_cached_blocks,
            prefix_cache_queries=self.blocks.prefix_cache_queries,
            prefix_cache_hits=self.blocks.prefix_cache_hits,
            num_preemptions=self.num_preemptions, integrity_ok=self._integrity_ok,
            longest_wait_s=max([0.0] + [now - r.arrival for r in self.waiting]),
            queue_cap=self.admission.queue_cap(),
            ttft_slo_judged=o.ttft_judged, ttft_slo_missed=o.ttft_missed,
            tpot_slo_judged=o.tpot_judged, tpot_slo_missed=o.tpot_missed,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            **self.spec_counts.stats(),
            **self.mask_counts.stats(),
        )

    # --- planning ---------------------------------------------------------------------------

    def _micro_batch_cap(self) -> int:
        """Pipeline parallel: the sequences of the plan being made, an even share of those that
        could run over the micro-batches not yet in flight, so that every stage gets work."""
        ready = sum(not r.num_pending_tokens for r in self.running)
        ready += min(len(self.waiting), self.slots.num_free)
        return max(1, -(-ready // (self.pp - len(self._in_flight))))

    def _schedule_running(self, batch: list, budget: int, now: float,
                          speculate: bool, cap: int | None) -> tuple[int, bool]:
        preempted = False
        scheduled: set[str] = set()
        # NOTE: decodes get the budget first without sorting: a request is admitted only with
        # budget left after every running one got its whole remainder, so only the last running
        # request can be part-way through its prefill.
        for req in list(self.running):
            if budget == 0 or (cap is not None and len(batch) >= cap):
                break
            # preempted for an earlier one, or its plans in flight end it
            if req.status is not RUNNING or self._ends_in_flight(req):
                continue
            if self.pp > 1 and req.num_pending_tokens:
                continue                     # its token is still on its way through the stages
            num = min(req.num_remaining_tokens, budget)
            guesses = fitting_guesses(req, budget, self.max_len) if speculate else []
            req.spec_token_ids = []
            if guesses and self.blocks.can_allocate(req, num + len(guesses)):
                num += len(guesses)             # speculation never preempts anything
            else:
                guesses = []
            while not self.blocks.can_allocate(req, num):
                candidates = [r for r in self.running if r.id not in scheduled]
                # NOTE: the fairness guard: an overdue request gives way last, or it could be
                # preempted again each time it is readmitted
                victim = self.policy.pick_victim(
                    [r for r in candidates if not self._overdue(r, now)] or candidates)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is RUNNING:
                batch.append(self._plan(req, num, self.blocks.allocate(req, num), guesses))
                scheduled.add(req.id)
                budget -= num
        return budget, preempted

    def _overdue(self, req: Request, now: float) -> bool:
        """Whether the fairness guard holds for `req`: it arrived more than max_wait_s ago."""
        return req.arrival < now - self.config.max_wait_s

    def _plan(self, req: Request, num: int, new_block_ids: list[int],
              guesses: list[int] | None = None) -> _Planned:
        """The step computing the next num tokens of `req` (blocks allocated; the last of
        them its `guesses`, if any). Advances its progress now; the token it samples, if it
        reaches the last known or pending token, becomes pending."""
        guesses = guesses or []
        start = req.num_computed_tokens
        end = start + num
        sample = end - len(guesses) == req.num_planned_tokens
        step = SeqStep(req.slot, num, new_block_ids, sample,
                       prompt_logprobs.first_position(req, start, end), guesses)
        if self.pp > 1:
            step.token_ids = req.token_ids[req.num_sent_tokens:]
            req.num_sent_tokens = req.num_tokens
        req.num_computed_tokens = end
        req.num_pending_tokens += sample
        self.num_prompt_tokens += max(0, min(end, req.prompt_len) - start)
        return _Planned(req, step, end, req.stats.num_preemptions)

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether the tokens pending for `req` surely end it (max_tokens, length limit): then it
        is not planned again. An end by EOS or a stop token cannot be foreseen; such a request is
        planned on, and update() drops the token of its step after the stop."""
        max_tokens = req.sampling.max_tokens
        return req.num_pending_tokens > 0 and (
            (max_tokens is not None
             and req.num_output_tokens + req.num_pending_tokens >= max_tokens)
            or req.num_planned_tokens >= self.max_len)

    def _preempt(self, req: Request) -> None:
        """Free the blocks and slot of a running request; it is recomputed once readmitted."""
        self.running.remove(req)
        self.blocks.free(req)
        self._release_slot(req)
        req.spec_token_ids = []
        req.status = WAITING
        req.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
