"""Admitting waiting requests into the step being planned (docs/SCHEDULING.md).

Waiting requests are admitted in the policy's order, behind the fairness guard: a request older
than `max_wait_s` goes first, skips the policy's `admit`, and is neither preempted for a waiting
request nor, while a younger one can give way, for blocks. One that does not fit may take the
place of running requests the policy lets it preempt, if enough of them give way. `admission.py`
sizes what fits from the pool and the lengths seen. A part of the Scheduler class: it reads and
changes the scheduler's queues, blocks and slots.
"""
from __future__ import annotations

from conveyor.scheduler.policy import SchedulingContext
from conveyor.scheduler.request import Request, RequestStatus
from conveyor.shared.messages.worker import NewSeq

WAITING, RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING


class AdmitWaiting:
    """Scheduler's admission of waiting requests (a mixin: the state is the Scheduler's)."""

    def _admit_waiting(self, batch: list, new: list[NewSeq], budget: int, now: float,
                       cap: int | None) -> None:
        """Admit waiting requests into the step being planned (`batch`, with `budget` tokens
        left and at most `cap` sequences), their NewSeqs into `new`."""
        if not self.waiting:
            return
        ctx = SchedulingContext(now, self.step_time_s, self.config.max_num_batched_tokens,
                                len(self.running))
        cutoff = now - self.config.max_wait_s
        overdue = [r for r in self.waiting if r.arrival < cutoff]
        order = sorted(overdue, key=lambda r: (r.arrival, r.arrival_index)) + \
            self.policy.order_waiting([r for r in self.waiting if r.arrival >= cutoff], ctx)
        growth: int | None = None            # see _victims
        admitted: list[Request] = []
        for req in order:
            # NOTE: a request preempted with a sampled token in flight waits for that token: a
            # NewSeq carries every token.
            if budget == 0 or req.num_pending_tokens or (cap is not None and len(batch) >= cap):
                break
            if req.arrival >= cutoff and not self.policy.admit(req, admitted, ctx):
                continue
            if not self._lora_fits(req):
                continue
            use_cache = req.sampling.prompt_logprobs is None   # every position must be computed
            prefix = self.blocks.lookup(req) if use_cache else []
            start = len(prefix) * self.blocks.block_size
            num = min(req.num_tokens - start, budget)
            victims, growth = self._victims(req, num, prefix, growth, admitted, ctx)
            if victims is None:
                break
            for victim in victims:
                budget += self._unplan(victim, batch)
                self._preempt(victim)
            num_cached = self.blocks.allocate_prefix(req, prefix)
            self.blocks.allocate(req, num)
            req.status, req.slot = RUNNING, self.slots.allocate()
            if not req.stats.first_scheduled:
                req.stats.first_scheduled = now
                req.stats.num_cached_tokens = num_cached
            self.running.append(req)
            new.append(NewSeq(req.slot, list(req.token_ids), req.prompt_len, req.sampling,
                              list(req.block_table), num_cached, req.lora))
            req.num_sent_tokens = req.num_tokens
            batch.append(self._plan(req, num, []))
            budget -= num
            if growth is not None:
                growth += self.admission.expected_growth(req)
            admitted.append(req)
            # NOTE: only the last running request may be part-way through its prefill (see
            # _schedule_running), even when preempting gave budget back
            if num < req.num_tokens - start:
                break
        if admitted:
            self.waiting = [r for r in self.waiting if r.status is WAITING]

    def _lora_fits(self, req: Request) -> bool:
        """Whether req's adapter can run beside the running requests: a step uses at most
        max_loras adapters (the workers' device slots), so a request whose adapter would be one
        too many waits (others behind it may go first) until one of them finishes."""
        if req.lora is None:
            return True
        active = {r.lora.lora_int_id for r in self.running if r.lora is not None}
        return req.lora.lora_int_id in active or len(active) < self.config.max_loras

    def _victims(self, req: Request, num: int, prefix: list[int], growth: int | None,
                 admitted: list[Request], ctx: SchedulingContext
                 ) -> tuple[list[Request] | None, int | None]:
        """The running requests to preempt so that `req` fits with num tokens after `prefix`
        ([] if it fits as it is; None if it cannot be made to fit), and `growth`.

        It fits with a free slot and, while anything runs, blocks for its expected length beyond
        the expected growth of the running requests (at least the watermark): admission.py.
        `growth` is that growth in blocks, or None until needed: it takes a pass over the running
        requests, which a step with no free slot (the common case under load) skips.
        """
        expected = max(num, self.admission.expected_len(req) - len(prefix) * self.blocks.block_size)
        victims: list[Request] = []
        candidates = None
        free_slots, free_blocks = self.slots.num_free, self.blocks.num_free_blocks
        while True:
            if free_slots:
                if len(self.running) == len(victims):
                    needed, reserve = self.blocks.num_needed(req, num, prefix), 0
                else:
                    if growth is None:
                        growth = sum(self.admission.expected_growth(r) for r in self.running
                                     if r not in victims)
                    needed = self.blocks.num_needed(req, expected, prefix)
                    reserve = max(self._watermark, growth)
                if needed + reserve <= free_blocks:
                    return victims, growth
            if candidates is None:
                taken = set(admitted)
                candidates = [r for r in self.running
                              if self.policy.may_preempt(req, r, ctx) and r not in taken
                              and not self._overdue(r, ctx.now) and not self._ends_in_flight(r)]
            if not candidates:
                return None, growth
            victim = self.policy.pick_victim(candidates)
            candidates.remove(victim)
            victims.append(victim)
            free_slots += 1
            free_blocks += self.blocks.num_exclusive(victim)
            if growth is not None:
                growth -= self.admission.expected_growth(victim)

    def _unplan(self, req: Request, batch: list) -> int:
        """Take the part of `req` out of the step being planned (its blocks go when it is
        preempted); returns the tokens it had."""
        for i, p in enumerate(batch):
            if p.req is req:
                del batch[i]
                req.num_pending_tokens -= p.step.sample
                start = p.end - p.step.num_tokens
                self.num_prompt_tokens -= max(0, min(p.end, req.prompt_len) - start)
                return p.step.num_tokens
        return 0
