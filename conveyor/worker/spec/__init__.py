"""Speculative decoding in the worker: proposers guess a sequence's next tokens; `verify` scores
the guesses against the target model's own sampling (rejection sampling, exact).

A proposer is one file here with a class that has `propose`. Proposals are made on every rank
alike (the guesses of rank 0's tokens), after a step's tokens are appended, and go back to the
scheduler in the StepResult; the scheduler sends those it budgets back in the next plan
(docs/SPECULATIVE.md). `make_proposer` builds the model-free ones (ngram). A proposer that runs a
model (draft_model.py; EAGLE heads would be another) also has the `ModelProposer` hooks: the model
runner sizes its KV pool with the target's, runs it alongside each forward pass, and asks it for
the distribution its guesses were drawn from when they are verified.
"""
from __future__ import annotations

from typing import Protocol

import torch

from conveyor.shared.speculative import SpeculativeConfig
from conveyor.worker.sampler import SeqSamplingState


class Proposer(Protocol):
    def propose(self, slots: list[int], states: list[SeqSamplingState]) -> list[list[int]]:
        """Up to num_speculative_tokens guessed next tokens of each sequence (slot ids and
        their sampling states, whose token_ids end with the last known token)."""


class ModelProposer(Proposer, Protocol):
    def kv_bytes_per_block(self) -> int:
        """Its KV bytes per block of the shared pool (block ids are the scheduler's)."""

    def scratch_bytes(self) -> int:
        """Bytes of its pool beyond the shared blocks."""

    def bind(self, num_blocks: int, slots: dict, inputs, sampler, graph_args) -> None:
        """Allocate its pool once the shared one is sized (ModelRunner.__init__)."""

    def alongside(self, dev: dict[str, torch.Tensor], graph, num_seqs: int, ctx) -> None:
        """Run on the inputs of the target's step just queued."""

    def draft_probs(self, slots: list[int], drafts: list[list[int]],
                    states: list[SeqSamplingState]) -> torch.Tensor | None:
        """q of a verify step's rows, [R, V] (None: greedy only, or point masses)."""


class NoGuesses:
    """The proposer of a rank whose guesses would go unused (a draft held whole by rank 0,
    draft_model.py): it guesses nothing, and its steps read their tokens where rank 0's do."""

    def propose(self, slots: list[int], states: list[SeqSamplingState]) -> list[list[int]]:
        return [[] for _ in states]


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from conveyor.worker.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                             config.prompt_lookup_max)
    raise ValueError(f"speculative_config: method {config.method!r} runs a model: the model "
                     f"runner builds it (spec/draft_model.py)")
