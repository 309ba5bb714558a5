"""Sampling parameters of one request, shared by every process.

A msgspec Struct so it travels on the wire as it is. Bad values raise ValueError naming the field,
both when a user builds one and when one is decoded from a socket.
"""
from __future__ import annotations

import math

import msgspec

from conveyor.shared.structured_outputs import StructuredOutputs


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0                 # 0 means greedy
    top_p: float = 1.0                       # in (0, 1]
    top_k: int = 0                           # 0 or -1: disabled
    min_p: float = 0.0                       # in [0, 1]
    presence_penalty: float = 0.0            # in [-2, 2]
    frequency_penalty: float = 0.0           # in [-2, 2]
    repetition_penalty: float = 1.0          # > 0; 1 is off
    seed: int | None = None
    max_tokens: int | None = 16              # None: up to the model's context length
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    logprobs: int | None = None              # top-k logprobs per generated token (0: sampled only)
    prompt_logprobs: int | None = None       # top-k logprobs per prompt token
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None   # only these may be drawn (vLLM's)
    # words never generated (vLLM's): the frontend turns each into the token ids it may take
    # (bad_words_token_ids); the last token of one is banned where its others were just drawn
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []
    # the prompt's last k tokens only (vLLM's; -1: as many as leave room for max_tokens)
    truncate_prompt_tokens: int | None = None
    # the output must match a JSON schema, a regex, a choice or a grammar (structured_outputs.py)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens"):
            _check(_fits_int64(getattr(self, name)), name, "must fit in 64 bits",
                   getattr(self, name))
        _check(all(_fits_int64(t) for t in self.stop_token_ids), "stop_token_ids",
               "must fit in 64 bits", self.stop_token_ids)
        for name in _FLOATS:       # inf and nan pass a range check on one side only
            _check(math.isfinite(getattr(self, name)), name, "must be a finite number",
                   getattr(self, name))
        _check(self.n >= 1, "n", "must be at least 1", self.n)
        _check(self.temperature >= 0, "temperature", "must be non-negative", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be 0 or -1 (off) or positive", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2 <= getattr(self, name) <= 2, name, "must be in [-2, 2]", getattr(self, name))
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be positive",
               self.repetition_penalty)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1",
               self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be non-negative", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must not exceed max_tokens", self.min_tokens)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings", self.stop)
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids", self.stop_token_ids)
        if self.logit_bias:
            _check(all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in self.logit_bias),
                   "logit_bias", "keys must be token ids", list(self.logit_bias)[:5])
            _check(all(-100 <= v <= 100 for v in self.logit_bias.values()), "logit_bias",
                   "values must be in [-100, 100]", self.logit_bias)
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids) and all(
                isinstance(t, int) and 0 <= t <= INT64_MAX for t in self.allowed_token_ids),
                "allowed_token_ids", "must be a non-empty list of token ids",
                self.allowed_token_ids[:5])
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
               "must be non-empty words", self.bad_words[:5])
        _check(all(ids and all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in ids)
                   for ids in self.bad_words_token_ids), "bad_words_token_ids",
               "must be non-empty lists of token ids", self.bad_words_token_ids[:5])
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
               or 1 <= self.truncate_prompt_tokens <= INT64_MAX, "truncate_prompt_tokens",
               "must be -1 or at least 1", self.truncate_prompt_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                   f"must be between 0 and {MAX_LOGPROBS}", value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


MAX_LOGPROBS = 20
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _fits_int64(value: int | None) -> bool:
    """msgpack and torch take integers of at most 64 bits; a bigger one must fail here, where the
    error names the field, not when a message is encoded."""
    return value is None or INT64_MIN <= value <= INT64_MAX


def _check(ok: bool, field: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{field} {rule}, got {value!r}")
