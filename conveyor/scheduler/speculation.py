"""Speculative decoding's rules in the scheduler: which plans ask for guesses, which guesses a
step verifies, and how a request backs off where its guesses do not pay (docs/SPECULATIVE.md).

A plan that verifies runs alone (the next plan needs to know how many guesses were accepted),
so the host's share of the step is not hidden behind the device's. N-gram guesses are looked up
when a step's tokens are read, while the plan after it already runs (`overlapped`): every plan
asks, and guesses that follow a token still being drawn by that plan are those after the first
(which guesses that token). A draft model's guesses are its own steps right after the target's,
so a plan that asks for them runs alone as well.

A request's guesses are verified while those it got accepted per verification (per asking plan
for a draft model, a lookup that found nothing counting 0) average at least SPEC_COST (a moving
average, weight SPEC_GAIN_EMA, hopeful at first). Below, it sits out its next 2, 4, ...
MAX_SPEC_WAIT plans. And since that plan runs alone for the whole batch, a plan verifies (asks,
for a draft model) only while the requests due add up to SPEC_COST a running request, or once
MAX_SPEC_WAIT plans passed without. Counting accepted guesses, not single misses, keeps rewriting
work speculating across the places between copied sentences (docs/BENCHMARKS.md).
"""
from __future__ import annotations

from conveyor.scheduler.request import Request

MAX_SPEC_WAIT = 8
SPEC_COST = 1.0
SPEC_GAIN_EMA = 0.5


class Asking:
    """The batch's side of the rule: whether the next plan verifies the guesses at hand
    (`overlapped` guesses) or asks for guesses (a draft model's)."""

    def __init__(self, overlapped: bool) -> None:
        self.overlapped = overlapped
        self.plans_since = 0                 # plans since the last one that verified / asked

    def due(self, running: list[Request]) -> bool:
        """Whether the next plan speculates: the requests due (not sitting out; with guesses
        at hand, for overlapped guesses) add up to SPEC_COST accepted guesses a running
        request, or it is long since a plan did (the requests due try again); the first plans
        (none running) do."""
        if not running:
            return True
        due = [r.spec_gain for r in running
               if not r.spec_wait and (r.spec_token_ids or not self.overlapped)]
        return bool(due) and (sum(due) >= SPEC_COST * len(running)
                              or self.plans_since >= MAX_SPEC_WAIT)

    def planned(self, speculated: bool, running: list[Request]) -> None:
        """A plan was made (with speculation configured): it verified or asked (`speculated`),
        else the requests sitting out count it."""
        if speculated:
            self.plans_since = 0
            return
        self.plans_since += 1
        for req in running:
            req.spec_wait = max(0, req.spec_wait - 1)


def back_off(req: Request, guesses: list[int], accepted: int | None) -> None:
    """After a plan that verified guesses of `req` (`accepted` of them) or looked for some
    (accepted None: `guesses` found, a draft model's, or none). Guesses found are verified next
    (a waiting request's too: its wait ends); otherwise the plan's accepted guesses (0 for a
    lookup that found nothing) move the average, and the request waits while it is low."""
    if accepted is None and guesses:
        req.spec_wait = 0
        return
    req.spec_gain += SPEC_GAIN_EMA * ((accepted or 0) - req.spec_gain)
    if req.spec_gain < SPEC_COST:
        req.spec_misses += 1
        req.spec_wait = min(2 ** req.spec_misses, MAX_SPEC_WAIT)
    else:
        req.spec_misses = req.spec_wait = 0


def next_guesses(req: Request, guesses: list[int]) -> list[int]:
    """What the next plan may verify of `guesses`, the worker's guesses of the tokens after the
    one just drawn for `req`: all of them with nothing planned meanwhile; with a one-token
    decode in flight (overlapped lookups), those after the first, which guesses its token;
    none while a verification is in flight (its guesses' KV is planned past the known and
    pending tokens) or the request sits out."""
    if req.spec_wait or req.num_computed_tokens >= req.num_planned_tokens:
        return []
    return guesses[1:] if req.num_pending_tokens else guesses


def fitting_guesses(req: Request, budget: int, max_len: int) -> list[int]:
    """The guesses of `req` its next step verifies: a decode (of a known token, or of one in
    flight), as many as the budget leaves (after its one token), max_tokens and the context
    allow."""
    guesses = req.spec_token_ids
    if not guesses or req.num_pending_tokens > 1 or req.num_remaining_tokens != 1:
        return []
    room = min(budget, max_len - req.num_planned_tokens)
    if req.sampling.max_tokens is not None:
        room = min(room, req.sampling.max_tokens - req.num_output_tokens
                   - req.num_pending_tokens)
    return guesses[:max(0, room - 1)]
