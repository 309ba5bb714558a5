"""What a user gets back: the shapes of vLLM's RequestOutput, so code written for it reads ours."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None                  # 1 = the most likely token
    decoded_token: str | None = None


# one dict per position: token id -> Logprob (the chosen token and the top-k)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None         # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None     # the stop token id or stop string that ended it
    error: str | None = None
    error_code: int | None = None            # with "error": 400 invalid, 429 overloaded, 5xx

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_output_tokens: int = 0

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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
