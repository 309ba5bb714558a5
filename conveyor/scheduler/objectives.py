"""Latency objectives met and missed, counted per sequence for the metrics.

A time-to-first-token objective is judged when the first token comes, or when a request ends
without one after its deadline (one cancelled earlier is not judged). A time-per-output-token
objective is judged when a request with at least two output tokens ends: its mean time between
output tokens after the first.
"""
from __future__ import annotations

from conveyor.scheduler.request import Request


class ObjectiveCounts:
    def __init__(self) -> None:
        self.ttft_judged = self.ttft_missed = 0
        self.tpot_judged = self.tpot_missed = 0

    def first_token(self, req: Request) -> None:
        ttft = req.options.ttft_slo
        if ttft is not None:
            self.ttft_judged += 1
            self.ttft_missed += req.stats.first_token - req.arrival > ttft

    def ended(self, req: Request, now: float) -> None:
        ttft, tpot = req.options.ttft_slo, req.options.tpot_slo
        if not req.stats.first_token:
            if ttft is not None and now - req.arrival > ttft:
                self.ttft_judged += 1
                self.ttft_missed += 1
        elif tpot is not None and req.num_output_tokens >= 2:
            self.tpot_judged += 1
            mean = (now - req.stats.first_token) / (req.num_output_tokens - 1)
            self.tpot_missed += mean > tpot
