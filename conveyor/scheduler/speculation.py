"""Speculative decoding's rules in the scheduler: which plans ask for guesses, which guesses a
step verifies, and how a request backs off where its guesses do not pay (docs/SPECULATIVE.md).

A plan that verifies or asks for guesses runs alone (the guesses need its tokens), so the host's
share of the step is not hidden behind the device's: on the default model about 1.5-2x the time
of an overlapped step. A request keeps asking while its guesses pay for that: while the guesses
it got accepted per asking plan average at least SPEC_COST (a moving average, weight
SPEC_GAIN_EMA, hopeful at first; a lookup that found nothing counts 0). Below, it sits out its
next 2, 4, ... MAX_SPEC_WAIT plans (the plan before a lookup waits for the last result, so a
wait of w overlaps w - 1 steps). And since a plan runs alone for the whole batch, it asks only
while the requests due add up to SPEC_COST a running request, or once MAX_SPEC_WAIT plans
passed without asking. Counting accepted guesses, not single misses, keeps rewriting work
asking across the empty lookups between copied sentences (docs/BENCHMARKS.md).
"""
from __future__ import annotations

from conveyor.scheduler.request import Request

MAX_SPEC_WAIT = 8
SPEC_COST = 1.0
SPEC_GAIN_EMA = 0.5


class Asking:
    """The batch's side of the rule: whether the next plan asks for guesses."""

    def __init__(self) -> None:
        self.plans_since = 0                 # plans since the last one that asked

    def due(self, running: list[Request]) -> bool:
        """Whether the next plan asks, speculation being on: the requests due to look (not
        sitting out) add up to SPEC_COST accepted guesses a running request, or it is long
        since a plan asked (the requests due look again); the first plans (none running) do."""
        if not running:
            return True
        due = [r.spec_gain for r in running if not r.spec_wait]
        return bool(due) and (sum(due) >= SPEC_COST * len(running)
                              or self.plans_since >= MAX_SPEC_WAIT)

    def planned(self, asked: bool, running: list[Request]) -> None:
        """A plan was made (with speculation configured); the requests sitting out count a plan
        that did not ask."""
        if asked:
            self.plans_since = 0
            return
        self.plans_since += 1
        for req in running:
            req.spec_wait = max(0, req.spec_wait - 1)


def back_off(req: Request, guesses: list[int], accepted: int | None) -> None:
    """After a plan that looked for guesses for `req` or verified some: `accepted` of the
    guesses it verified (None if it verified none) and what its lookup found. Guesses found are
    verified next (a waiting request's too: its wait ends); otherwise the plan's accepted
    guesses (0 for a lookup that found nothing) move the average, and the request waits while
    it is low."""
    if accepted is None and guesses:
        req.spec_wait = 0
        return
    req.spec_gain += SPEC_GAIN_EMA * ((accepted or 0) - req.spec_gain)
    if req.spec_gain < SPEC_COST:
        req.spec_misses += 1
        req.spec_wait = min(2 ** req.spec_misses, MAX_SPEC_WAIT)
    else:
        req.spec_misses = req.spec_wait = 0


def fitting_guesses(req: Request, budget: int, max_len: int) -> list[int]:
    """The guesses of `req` its next step verifies: a decode with nothing in flight, as many as
    the budget leaves (after its one token), max_tokens and the context allow."""
    guesses = req.spec_token_ids
    if not guesses or req.num_pending_tokens or req.num_remaining_tokens != 1:
        return []
    room = min(budget, max_len - req.num_tokens)
    if req.sampling.max_tokens is not None:
        room = min(room, req.sampling.max_tokens - req.num_output_tokens)
    return guesses[:max(0, room - 1)]
