"""The scheduler's checks: what a request may not ask (refused when it is added), and the
bookkeeping's integrity (blocks, queues, slots, pending tokens), run where it stalls no step. A
part of the Scheduler class (a mixin: the state is the Scheduler's).
"""
from __future__ import annotations

from collections import Counter

from conveyor.scheduler.block_manager import IntegrityError
from conveyor.scheduler.request import RequestStatus
from conveyor.shared.messages.engine import AddRequest

WAITING, RUNNING, FINISHED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED
AUDIT_INTERVAL_S = 60.0                      # a busy engine's bookkeeping check, at most this often


class Checks:
    """Scheduler's checks (a mixin: the state is the Scheduler's)."""

    def check_integrity(self) -> None:
        """Raise IntegrityError if any block or request bookkeeping is inconsistent."""
        try:
            self.blocks.check_integrity(r.block_table for r in self.running)
            self._check_requests()
        except IntegrityError:
            self._integrity_ok = False
            raise
        self._integrity_ok = True

    def audit(self) -> None:
        """check_integrity() where it stalls no step: whenever the engine is idle, else at most
        every AUDIT_INTERVAL_S. It walks every block (18 ms at 72,686 blocks on a 2-core Xeon),
        and no step is planned meanwhile, so a check on every stats request (each /metrics
        scrape) would hold up every running stream. The outcome is stats().integrity_ok."""
        now = self.clock()
        if self.has_work() and now - self._last_audit < AUDIT_INTERVAL_S:
            return
        self._last_audit = now
        try:
            self.check_integrity()
        except IntegrityError:
            pass                              # reported as integrity_ok=False

    def _reject_reason(self, msg: AddRequest) -> str | None:
        n = len(msg.token_ids)
        if msg.id in self.requests:
            return f"request id {msg.id!r} is already in use"
        if n == 0:
            return "the prompt is empty"
        if any(t < 0 for t in msg.token_ids):
            return "the prompt has negative token ids"
        if msg.options.priority and not self.policy.reads_priority:
            return (f"priority {msg.options.priority} is not used by the "
                    f"{self.config.scheduling_policy!r} scheduling policy; start the engine "
                    f"with scheduling_policy \"priority\" (--scheduling-policy priority)")
        if n >= self.max_model_len:
            return (f"the prompt has {n} tokens, but the model's context length is "
                    f"{self.max_model_len} (prompt plus at least one generated token)")
        if n >= self.max_len:
            return (f"the prompt has {n} tokens, but the KV cache holds only {self.max_len} "
                    f"tokens ({self.blocks.num_blocks} blocks of {self.blocks.block_size})")
        return None

    def _check_requests(self) -> None:
        running, waiting = {r.id for r in self.running}, {r.id for r in self.waiting}
        if (len(running) != len(self.running) or len(waiting) != len(self.waiting)
                or running & waiting or running | waiting != self.requests.keys()):
            raise IntegrityError("waiting and running queues do not partition the request table")
        self.slots.check_integrity([r.slot for r in self.running])
        # guesses in flight: their KV is planned ahead of the tokens known or pending
        guesses = Counter()
        for _, planned, _ in self._in_flight:
            for p in planned:
                guesses[p.req] += len(p.step.draft_token_ids)
        for r in self.running:
            if (r.status is not RUNNING
                    or r.num_computed_tokens - guesses[r] >= r.num_planned_tokens
                    or len(r.block_table) * self.blocks.block_size < r.num_computed_tokens):
                raise IntegrityError(f"running request {r.id} is in a bad state")
        for r in self.waiting:
            if (r.status is not WAITING or r.slot is not None or r.block_table
                    or r.num_computed_tokens):
                raise IntegrityError(f"waiting request {r.id} holds a slot, blocks or progress")
        pending = Counter(p.req for _, planned, _ in self._in_flight for p in planned
                          if p.step.sample and p.req.status is not FINISHED)
        for r in self.requests.values():
            if r.num_pending_tokens != pending[r]:
                raise IntegrityError(f"request {r.id} counts {r.num_pending_tokens} pending "
                                     f"tokens, but {pending[r]} sampling steps are in flight")
