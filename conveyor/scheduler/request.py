"""Scheduler-side state of one request: its tokens, progress, blocks and worker slot.

Built from an `AddRequest`; mutated only by the scheduler and its block manager. Token ids are
append-only: the prompt, then every sampled token.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.shared.lora import LoRARequest
from conveyor.shared.messages.engine import AddRequest, RequestStats
from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"                      # queued, or preempted; holds no blocks and no slot
    RUNNING = "running"                      # holds blocks and a worker slot
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    id: str
    token_ids: list[int]                     # prompt + output so far
    prompt_len: int
    sampling: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)
    arrival: float = 0.0
    lora: LoRARequest | None = None          # its adapter (None: the base model)
    arrival_index: int = 0                   # order of `add` calls, breaks ties between arrivals
    status: RequestStatus = RequestStatus.WAITING
    # NOTE: the first num_computed_tokens tokens have their KV in the blocks of block_table, or
    # will have once the planned steps have run (it advances when a step is planned).
    num_computed_tokens: int = 0
    # NOTE: tokens sampled by planned steps whose results are not applied yet (overlap scheduling):
    # known to exist, value unknown; they follow token_ids. At most one per step in flight.
    num_pending_tokens: int = 0
    # NOTE: pipeline parallel: tokens of token_ids the workers' slot has (the rest go to them in
    # the next SeqStep); set when it enters a slot
    num_sent_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # of its full blocks, by content
    num_cached_blocks: int = 0               # leading blocks already offered to the prefix cache
    slot: int | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    num_prompt_logprobs_sent: int = 0        # prompt positions 1.. delivered to the frontend
    # speculative decoding: the worker's guesses of the tokens after the last one, made with the
    # last result; valid only while nothing more is planned for it
    spec_token_ids: list[int] = field(default_factory=list)
    # guesses accepted per plan that looked for them, a moving average (spec_gain; hopeful at
    # first); while it is below SPEC_COST, asks in a row that left it there (spec_misses) and
    # the plans still to pass before it asks again (its steps meanwhile overlap)
    spec_gain: float = 2.0
    spec_misses: int = 0
    spec_wait: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @classmethod
    def from_message(cls, msg: AddRequest, arrival_index: int = 0) -> Request:
        return cls(
            id=msg.id, token_ids=list(msg.token_ids), prompt_len=len(msg.token_ids),
            sampling=msg.sampling, options=msg.options, arrival=msg.arrival, lora=msg.lora,
            arrival_index=arrival_index, stats=RequestStats(arrival=msg.arrival),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_planned_tokens(self) -> int:
        """Known and pending tokens: the length the request has once its planned steps are done."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Known or pending tokens whose KV is not computed (nor planned); 1 in decode."""
        return self.num_planned_tokens - self.num_computed_tokens

    def due(self) -> float | None:
        """When its next token is due under its objectives (a time.time()), or None when no
        objective is at stake: the first token at arrival + ttft_slo; after it, the next one
        while the mean time per output token stays within tpot_slo."""
        ttft, tpot = self.options.ttft_slo, self.options.tpot_slo
        if not self.stats.first_token:
            return None if ttft is None else self.arrival + ttft
        if tpot is None:
            return None
        return self.stats.first_token + tpot * self.num_output_tokens
