"""Prompt logprobs: which positions a step returns, and delivering each one exactly once.

Computing token i yields the distribution of token i + 1, so a step computing tokens [start, end)
can give prompt positions [start + 1, min(end + 1, prompt_len)); position 0 has none. For a SeqStep
with prompt_logprobs_from = f >= 0 the worker returns positions [f, min(end + 1, prompt_len)).
"""
from __future__ import annotations

from conveyor.scheduler.request import Request
from conveyor.shared.messages.worker import TokenLogprobs


def first_position(req: Request, start: int, end: int) -> int:
    """prompt_logprobs_from for a step computing tokens [start, end) of `req`; -1: none."""
    if req.sampling.prompt_logprobs is None:
        return -1
    first = max(start + 1, req.num_prompt_logprobs_sent + 1)    # skip what was delivered
    return first if first < min(end + 1, req.prompt_len) else -1


def take_new(req: Request, first: int, entries: list[TokenLogprobs]) -> list[TokenLogprobs]:
    """The entries (positions first, first + 1, ...) not delivered yet; marks them delivered."""
    next_position = req.num_prompt_logprobs_sent + 1
    fresh = entries[max(0, next_position - first):][:req.prompt_len - next_position]
    req.num_prompt_logprobs_sent += len(fresh)
    return fresh
