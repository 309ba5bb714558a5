"""scheduler <-> workers: the StepPlan each rank runs, and the sampling rank's StepResult.

A plan is a delta: a sequence is sent whole once, when it takes a worker slot (NewSeq); after that
only what changed (its token count for the step, new block ids, under pipeline parallelism the
tokens drawn since) and the slots freed since. Every rank gets every plan; the rank that samples
(the first rank of the last pipeline stage) sends the StepResult.
"""
from __future__ import annotations

import msgspec

from conveyor.shared.lora import LoRARequest
from conveyor.shared.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top-k (rank order)."""
    token_ids: list[int]
    logprobs: list[float]
    rank: int                                # rank of the chosen token among all (1 = most likely)


class NewSeq(msgspec.Struct, array_like=True):
    """A sequence the worker has not seen in this slot: sent once, whole."""
    slot: int
    token_ids: list[int]                     # prompt, plus output so far when resumed
    prompt_len: int                          # tokens of the original prompt (for penalties)
    sampling: SamplingParams
    block_ids: list[int]
    num_computed: int                        # tokens whose KV is already in the blocks (prefix hit)
    lora: LoRARequest | None = None          # its adapter (loaded by the worker when first used)


class SeqStep(msgspec.Struct, array_like=True):
    """What one sequence does in a step."""
    slot: int
    num_tokens: int                          # tokens to compute from its num_computed on
    new_block_ids: list[int]                 # appended to its block table before the step
    sample: bool                             # sample after this chunk (last prompt chunk, decode)
    prompt_logprobs_from: int = -1           # first prompt position to return logprobs for, or -1
    # speculative decoding: guesses of the tokens after its last one, verified in this step
    # (num_tokens is then 1 + their count; rows for each are sampled, see StepResult)
    draft_token_ids: list[int] = []
    # pipeline parallel: its tokens drawn since the workers last ran it, which the stages that
    # do not sample append before the step (the last stage drew them itself)
    token_ids: list[int] = []


class StepPlan(msgspec.Struct):
    step: int
    new: list[NewSeq]                        # new or resumed sequences, before `seqs` is run
    seqs: list[SeqStep]                      # the batch, in order
    freed: list[int]                         # slots whose sequences ended or were preempted
    propose: bool = False                    # guess the next tokens of each sampled sequence


class StepResult(msgspec.Struct):
    step: int
    # the tokens of each SeqStep with sample=True, in order, back to back: one each, or with
    # guesses num_sampled[i] (the accepted guesses and one more)
    sampled: list[int]
    logprobs: list[TokenLogprobs | None]     # parallel to `sampled`; None where not asked
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]]]  # (slot, positions from its _from)
    num_sampled: list[int] = []              # per sampling SeqStep; empty: one token each
    proposals: list[list[int]] = []          # plan.propose: per sampling SeqStep, its guesses
    propose_time_s: float = 0.0              # host time spent making `proposals`
    # structured outputs: the step's constrained rows, its bitmask fill's time (advancing the
    # matchers and filling, on the fill thread or the step loop) and the step loop's wait for it
    mask_rows: int = 0
    mask_fill_s: float = 0.0
    mask_wait_s: float = 0.0
