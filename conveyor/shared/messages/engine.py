"""frontend <-> scheduler: requests in, tokens out (one TokenOutputs per step per frontend)."""
from __future__ import annotations

import msgspec

from conveyor.shared.lora import LoRARequest
from conveyor.shared.messages.worker import TokenLogprobs
from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, kw_only=True):
    id: str                                  # <frontend's request id>/<sample index>
    token_ids: list[int]
    sampling: SamplingParams
    options: RequestOptions = msgspec.field(default_factory=RequestOptions)
    arrival: float = 0.0                     # time.time() when the frontend accepted it
    lora: LoRARequest | None = None          # the adapter options.lora names, resolved


class Abort(msgspec.Struct, kw_only=True):
    ids: list[str]
    reason: str = "abort"                    # "abort" (client went away) or "stop" (stop string)


class RequestStats(msgspec.Struct, array_like=True, omit_defaults=True):
    arrival: float = 0.0
    first_scheduled: float = 0.0
    first_token: float = 0.0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0                # speculative decoding: guesses verified
    num_accepted_tokens: int = 0             # ... and accepted


class TokenOutput(msgspec.Struct, omit_defaults=True):
    id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None          # one per new token
    prompt_logprobs: list[TokenLogprobs] | None = None   # new prompt positions, in order
    finish_reason: str | None = None         # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None     # the stop token id that ended it, if any
    error: str | None = None
    error_code: int | None = None            # with "error": 400 invalid, 429 overloaded, 500 failed
    stats: RequestStats | None = None        # sent with the first token and when finished


class TokenOutputs(msgspec.Struct):
    outputs: list[TokenOutput]


class StatsRequest(msgspec.Struct):
    """Asks for a Stats (from a client of a frontend, or from a frontend of the scheduler)."""


class Stats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    integrity_ok: bool = True
    longest_wait_s: float = 0.0              # age of the oldest waiting request (0: none waits)
    queue_cap: int | None = None             # waiting requests beyond this are refused (429)
    # sequences whose latency objective was judged, and those that missed it
    ttft_slo_judged: int = 0
    ttft_slo_missed: int = 0
    tpot_slo_judged: int = 0
    tpot_slo_missed: int = 0
    # tokens the engine computed: prompt tokens (prefill, prefix-cache hits not counted) and
    # generated ones, since start
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    # speculative decoding since start: sequence steps that verified guesses, the guesses and
    # those accepted, and the time spent proposing (worker host) and in steps that verified
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_propose_s: float = 0.0
    spec_verify_steps: int = 0
    spec_verify_s: float = 0.0
    # structured outputs since start: steps that took a token bitmask, their constrained rows,
    # the bitmask fills' time on worker rank 0 and the step loop's waits for them
    structured_steps: int = 0
    structured_rows: int = 0
    structured_fill_s: float = 0.0
    structured_wait_s: float = 0.0
    # filled in by the frontend that answers a client's StatsRequest, about itself
    frontend_open_requests: int = 0          # requests it still owes an answer
    # data parallel (--data-parallel-size > 1): the fields above are sums over the live
    # replicas; each live one's own Stats (with its index) is in `replicas`
    replica: int | None = None
    replicas: list[Stats] = []
    dead_replicas: list[int] = []
