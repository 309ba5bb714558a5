"""Speculative decoding in the worker: proposers guess a sequence's next tokens; `verify` scores
the guesses against the target model's own sampling (rejection sampling, exact).

A proposer is one file here with a class that has `propose`; `make_proposer` maps a
SpeculativeConfig's method to it. Proposals are made on every rank alike (the guesses of rank
0's tokens), after a step's tokens are appended, and go back to the scheduler in the StepResult;
the scheduler sends those it budgets back in the next plan (docs/SPECULATIVE.md).
"""
from __future__ import annotations

from typing import Protocol

from conveyor.shared.speculative import SpeculativeConfig
from conveyor.worker.sampler import SeqSamplingState


class Proposer(Protocol):
    def propose(self, slots: list[int], states: list[SeqSamplingState]) -> list[list[int]]:
        """Up to num_speculative_tokens guessed next tokens of each sequence (slot ids and
        their sampling states, whose token_ids end with the last known token)."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from conveyor.worker.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                             config.prompt_lookup_max)
    raise ValueError(f"speculative_config: method {config.method!r} is not available yet")
