"""Speculative decoding's configuration: vLLM's `--speculative-config` JSON, parsed and checked.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "PATH", "num_speculative_tokens": 4}
    {"method": "draft_model", "draft_num_layers": 4, "num_speculative_tokens": 4}
    {"method": "draft_model", "model": "PATH", "num_speculative_tokens": 4,
     "draft_tensor_parallel_size": 1}

A proposer (conveyor/worker/spec/) guesses up to num_speculative_tokens next tokens of a
sequence; the target model scores them all in one forward pass and keeps the longest run its
own sampling agrees with (docs/SPECULATIVE.md). Torch-free: the scheduler reads it too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


# NOTE: measured on an H200 with the default model and n-gram guesses (docs/BENCHMARKS.md,
# "Speculative decoding"): 1.97x at batch 1, 1.17x at 4, even at 16, 0.66x at 64
DISABLE_BY_BATCH_SIZE = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix of the sequence looked up earlier in it (vLLM's
    # rule: one given sets the other; neither: both 5)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None                 # draft_model: its folder or .gguf file
    # draft_model: the draft is the first N decoder layers of `model` (or, without one, of the
    # target itself) followed by its final norm and head: a model drafting for itself
    draft_num_layers: int | None = None
    # draft_model: 1 runs the draft whole on the first rank (for a draft whose heads do not
    # split over the target's ranks); None or the target's tensor_parallel_size shards it
    draft_tensor_parallel_size: int | None = None
    # no speculation while at least this many requests run: a large batch is compute-bound,
    # and a step that verifies gives up the overlap of planning with the device
    disable_by_batch_size: int | None = None          # None: DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        def fail(key: str, rule: str) -> None:
            raise ValueError(f"speculative_config: {key} {rule}, got {getattr(self, key)!r}")

        def positive_int(key: str) -> None:
            value = getattr(self, key)
            if value is not None and (type(value) is not int or value < 1):
                fail(key, "must be a positive integer")

        if self.method not in METHODS:
            fail("method", f"must be one of {', '.join(METHODS)}")
        if self.num_speculative_tokens is None:
            fail("num_speculative_tokens", "is required")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "disable_by_batch_size", "draft_num_layers", "draft_tensor_parallel_size"):
            positive_int(key)
        if self.disable_by_batch_size is None:
            object.__setattr__(self, "disable_by_batch_size", DISABLE_BY_BATCH_SIZE)
        if self.num_speculative_tokens > 32:
            fail("num_speculative_tokens", "must be at most 32")
        if self.method == "ngram":
            for key in ("model", "draft_num_layers", "draft_tensor_parallel_size"):
                if getattr(self, key) is not None:
                    fail(key, "is for method draft_model only")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo or hi or 5), (hi or lo or 5)
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if lo > hi:
                fail("prompt_lookup_min", f"must not exceed prompt_lookup_max ({hi})")
        else:
            if self.model is None and self.draft_num_layers is None:
                fail("model", "must name the draft model (a folder or .gguf file), or "
                              "draft_num_layers the target's layers it drafts with")
            if self.model is not None and (not isinstance(self.model, str) or not self.model):
                fail("model", "must name the draft model (a folder or .gguf file)")
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    fail(key, "is for method ngram only")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From a JSON object (text, as on the command line) or a dict; ValueError naming the
        key that is wrong."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError("speculative_config: method is required")
        return cls(**{"num_speculative_tokens": None, **value})

    @property
    def overlapped(self) -> bool:
        """Whether guesses come with the next step already in flight: n-gram lookups are host
        work done when a step's tokens are read, so a plan that asks for them overlaps the next
        as any other, and only a plan that verifies runs alone. A draft model's guesses are its
        own steps on the device right after the target's, so a plan asking for them runs alone."""
        return self.method == "ngram"

    def speculates(self, num_running: int) -> bool:
        """Whether steps with this many running requests verify guesses."""
        return num_running < self.disable_by_batch_size
