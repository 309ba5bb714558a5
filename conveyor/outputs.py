"""What every client gets back: `LLM.generate`, the ZMQ client and the HTTP server read the same
structs. They have the shapes of vLLM's RequestOutput, so code written for it reads ours; they are
msgspec Structs, so the ZMQ server sends them as they are. A streamed output is a delta: each
CompletionOutput carries only the text, token ids and logprobs that are new since the last one.
"""
from __future__ import annotations

import msgspec


class Logprob(msgspec.Struct, array_like=True):
    logprob: float
    rank: int | None = None                  # 1 = the most likely token
    decoded_token: str | None = None


# one dict per position: token id -> Logprob (the chosen token first, then the top-k)
PositionLogprobs = dict[int, Logprob]


class CompletionOutput(msgspec.Struct, omit_defaults=True):
    index: int                               # which of the n samples
    text: str = ""
    token_ids: list[int] = []
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None         # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None     # the stop token id or stop string that ended it
    error: str | None = None
    error_code: int | None = None            # with "error": 400 invalid, 429 overloaded, 5xx

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct, omit_defaults=True):
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_output_tokens: int = 0
    # speculative decoding: guessed tokens verified, and accepted (all samples)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


class RequestOutput(msgspec.Struct, omit_defaults=True):
    request_id: str = msgspec.field(name="id")   # "id" on the wire (docs/PROTOCOL.md)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None   # in a stream: in its first output only
    outputs: list[CompletionOutput] = []
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    metrics: RequestMetrics | None = None       # once finished

    # the first completion's, for the usual n = 1
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error
