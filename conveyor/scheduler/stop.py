"""Stop conditions, checked each time a request gains a sampled token.

EOS and `stop_token_ids` end a request with "stop", but only once it has `min_tokens` outputs
(before that the sampler bans them; a request with a grammar or allowed_token_ids draws EOS
only where its constraints allow nothing else, and then it ends: they win over min_tokens);
`max_tokens` and the context length end it with "length". Stop strings are the frontend's job.
"""
from __future__ import annotations

from conveyor.scheduler.request import Request


def check_stop(req: Request, eos_token_ids: frozenset[int], max_len: int) -> bool:
    """Whether the last token of `req` ends it; if so, sets finish_reason and stop_reason."""
    sampling = req.sampling
    token = req.token_ids[-1]
    num_outputs = req.num_output_tokens
    if (num_outputs >= sampling.min_tokens or sampling.structured_outputs is not None
            or sampling.allowed_token_ids):
        if token in eos_token_ids and not sampling.ignore_eos:
            req.finish_reason = "stop"
            return True
        if token in sampling.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
            return True
    if sampling.max_tokens is not None and num_outputs >= sampling.max_tokens:
        req.finish_reason = "length"
        return True
    if req.num_tokens >= max_len:
        req.finish_reason = "length"
        return True
    return False
