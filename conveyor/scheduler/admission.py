"""Admission control sized from the KV pool and the request lengths seen so far.

- Running: while anything runs, a waiting request is admitted only if the free blocks cover its
  prompt and what it and every running request are expected to grow to (the mean output length
  seen, within each one's max_tokens). So the number of running requests follows from the pool
  and the lengths, and an admission seldom forces a preemption later.
- Waiting (`conveyor serve`): at most QUEUE_DEPTH times as many requests as fit at once,
  min(max_num_seqs, blocks / the mean blocks of a request), are queued; more are refused (429).
  An explicit max_queued_requests is an upper bound. The offline API queues whatever it is given.
"""
from __future__ import annotations

import math

from conveyor.scheduler.request import Request

QUEUE_DEPTH = 8
WINDOW = 64                                  # lengths are averaged over about this many requests


class RunningMean:
    """The mean of the values seen, then (past WINDOW values) an exponential moving average."""

    def __init__(self) -> None:
        self.value = 0.0
        self.count = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) / min(self.count, WINDOW)


class Admission:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_len: int,
                 max_queued: int | None, derive_queue_cap: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_len = max_len
        self.max_queued = max_queued
        self.derive_queue_cap = derive_queue_cap
        self.prompt_len = RunningMean()      # of queued requests
        self.output_len = RunningMean()      # of requests that ended by stop or length

    def queue_cap(self) -> int | None:
        """How many requests may wait (None: no cap)."""
        if not self.derive_queue_cap:
            return self.max_queued
        per_request = max(1, self._blocks(self.prompt_len.value + self.output_len.value))
        cap = QUEUE_DEPTH * min(self.max_num_seqs, max(1, self.num_blocks // per_request))
        return cap if self.max_queued is None else min(cap, self.max_queued)

    def expected_len(self, req: Request) -> int:
        """The length `req` is expected to end at: the mean output length seen (within its
        max_tokens and the length limit), or more if it is longer already."""
        output = round(self.output_len.value)
        if req.sampling.max_tokens is not None:
            output = min(output, req.sampling.max_tokens)
        return max(req.num_planned_tokens, min(req.prompt_len + output, self.max_len))

    def expected_growth(self, req: Request) -> int:
        """Blocks `req` is expected to take beyond those it holds."""
        return max(0, self._blocks(self.expected_len(req)) - len(req.block_table))

    def _blocks(self, num_tokens: float) -> int:
        return math.ceil(num_tokens / self.block_size)
