"""Structured outputs in the worker that samples (rank 0): a matcher per constrained sequence, and
each step's token bitmask for the sampler (docs/ARCHITECTURE.md, "Structured outputs").

The model runner calls `start` when a sequence takes a slot (a resumed one replays its output so
far), `SeqGrammar.accept` as each sampled token reaches the host (at the flush of its step; it
only queues the token), and `fill` for a step's sampling rows after that flush: on a thread, the
matchers consume the queued tokens and the bitmask is filled while the step's forward pass runs
on the device and the engine plans the next step, and the sampling waits for it at the next
submit (docs/ARCHITECTURE.md, "Structured outputs").
The vocabulary view is built by the first constrained sequence (about a second, once).
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from conveyor.shared.grammar import GrammarCompiler, bitmask_width, build_tokenizer
from conveyor.shared.model_files import ModelFiles
from conveyor.shared.structured_outputs import StructuredOutputs
from conveyor.worker.sampler import SeqSamplingState
from conveyor.worker.sampling_ops import to_device

# NOTE: the fill thread takes the GIL to start llguidance's fill and again to return from it;
# while the step loop runs Python, each take waits for the loop's thread to yield, which it does
# every switch interval (CPython's default is 5 ms: a 0.5-1.5 ms fill then took 5-6 ms and the
# decode step with it). So the first fill on the thread lowers the process's interval to this
# (0.05 ms waited less for the mask than 0.2 ms on two H200 hosts: docs/BENCHMARKS.md,
# "Structured outputs").
GIL_SWITCH_S = 0.00005


class StructuredOutputMasks:
    def __init__(self, files: ModelFiles, tokenizer: str | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...], max_rows: int, device: torch.device):
        self.device = device
        self.vocab_size = vocab_size
        self._args = (files, tokenizer, vocab_size, eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._max_rows = max_rows
        self._host: torch.Tensor | None = None     # [max_rows, W] int32, pinned on CUDA
        self._fill_thread: ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            files, name, vocab_size, eos = self._args

            def tokenizer():
                from conveyor.frontend.tokenizer import load_tokenizer
                return build_tokenizer(load_tokenizer(files, name), vocab_size, eos)

            # NOTE: the tokenizer is built off the step loop too; compiles wait for it
            self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer")
            self._compiler = GrammarCompiler(self._tokenizer_pool.submit(tokenizer), vocab_size,
                                             eos)
        return self._compiler

    def start(self, state: SeqSamplingState, so: StructuredOutputs) -> None:
        """Give `state` a matcher; its output so far (a resumed sequence's) is replayed."""
        state.grammar = self.compiler.start(so, state.token_ids[state.prompt_len:])

    def masks(self, states: list[SeqSamplingState], row_of: list[int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bitmask [R, W] int32, rows [R] int64) on the device for the constrained rows of a
        step's sampling batch, or None if it has none; states[i]'s row is i, or row_of[i].
        Waits for grammars still compiling. A sequence whose constraint has not started
        (`SeqGrammar.free`: a thought) takes no mask."""
        return self.fill(states, row_of, later=False).get()

    def fill(self, states: list[SeqSamplingState], row_of: list[int] | None = None,
             later: bool = True, drafts: list[list[int]] | None = None) -> PendingMasks:
        """Start filling the bitmask of masks(states, row_of): on the fill thread if `later`
        (llguidance drops the GIL, so the step loop goes on meanwhile), else here.
        `PendingMasks.get()` waits for it and gives masks()'s value. With `drafts` (a step
        verifying guesses) states[i] has len(drafts[i]) + 1 rows from row_of[i], each masked
        after the guesses before it (`GrammarCompiler.fill_bitmask`)."""
        # a thought's guesses may end it: its rows are masked from there (fill_bitmask)
        rows = [i for i, s in enumerate(states)
                if masked(s) or (drafts and drafts[i] and s.grammar is not None)]
        if not rows:
            return PendingMasks(None, None, None, self.device)
        guesses = [drafts[i] for i in rows] if drafts else None
        if guesses:
            at = row_of or range(len(states))
            mask_rows = [at[i] + j for i, g in zip(rows, guesses) for j in range(len(g) + 1)]
        else:
            mask_rows = [row_of[i] for i in rows] if row_of else rows
        if self._host is None or self._host.shape[0] < len(mask_rows):
            self._host = torch.empty(max(self._max_rows, len(mask_rows)),
                                     bitmask_width(self.vocab_size), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        # NOTE: the buffer is reused: the previous step's copy from it is done, since the
        # runner waited for that step's results before this step's fill began.
        host = self._host[:len(mask_rows)]
        grammars = [states[i].grammar for i in rows]

        def run() -> float:
            t = time.perf_counter()
            self.compiler.fill_bitmask(grammars, host.numpy(), guesses)
            return time.perf_counter() - t

        pending = PendingMasks(host, mask_rows, None, self.device)
        if later:
            if self._fill_thread is None:
                self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
                sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
            pending.done = self._fill_thread.submit(run)
        else:
            pending.fill_s = pending.wait_s = run()     # the step loop ran it: all of it waited
        return pending


def masked(state: SeqSamplingState) -> bool:
    """Whether `state`'s rows take a mask now: it holds a matcher (the sampling rank does) and
    its constraint has started or may start at this token (not in a thought,
    `SeqGrammar.free`)."""
    return state.grammar is not None and not state.grammar.free


class PendingMasks:
    """A bitmask being filled (or filled): `get()` waits for the fill, then queues the copy to
    the device. Once got: `fill_s`, the fill's time (advancing the matchers and filling), and
    `wait_s`, how long the step loop waited for it."""

    def __init__(self, host: torch.Tensor | None, rows: list[int] | None, done: Future | None,
                 device: torch.device):
        self.host, self.rows, self.done, self.device = host, rows, done, device
        self.fill_s = self.wait_s = 0.0

    @property
    def num_rows(self) -> int:
        return len(self.rows) if self.host is not None else 0

    def ready(self) -> bool:
        """Whether get() would not wait for the fill."""
        return self.done is None or self.done.done()

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.host is None:
            return None
        if self.done is not None:
            t = time.perf_counter()
            self.fill_s = self.done.result()               # re-raises what the fill raised
            self.wait_s = time.perf_counter() - t
            self.done = None
        mask = (self.host.to(self.device, non_blocking=True) if self.device.type == "cuda"
                else self.host)
        return mask, to_device(self.rows, self.device, torch.long)
