"""A launched step's draw: its sampling (or the verification of its guesses), the copies of the
results to the host, and reading them back into the sequences.

The model runner queues a step's forward pass and hands the step here as a `Launched`; `sample`
queues the draw on the device (only rank 0 draws under tensor parallelism; the others take its
tokens), `read` waits for the host copies and appends the tokens to their sequences, and
`result` makes the StepResult the scheduler gets.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from conveyor.shared.messages.worker import StepResult
from conveyor.worker.layers.parallel import broadcast_tensor, tp_rank
from conveyor.worker.sampler import LogprobTensors, SampledTensors, Sampler, SeqSamplingState
from conveyor.worker.spec import ModelProposer, Proposer
from conveyor.worker.spec.verify import accepted_runs, verify
from conveyor.worker.structured import PendingMasks, StructuredOutputMasks


@dataclass
class Launched:
    """A step whose forward pass is queued; its sampling and the copies to the host follow."""
    step: int
    states: list[SeqSamplingState]                   # of the sampling sequences, in batch order
    logits: torch.Tensor | None                      # [S + P, vocab]: sampling, then prompt rows
    prompt_rows: list[tuple[int, list[int], int]]    # (slot, target ids, top-k) per sequence
    # speculative decoding: per sampling sequence its slot and guesses (then it has one
    # sampling row more than guesses); None: no guesses in this step, one row each
    drafts: list[list[int]] | None = None
    sample_slots: list[int] = field(default_factory=list)
    propose: bool = False                            # guess next tokens once the draw is read
    # sampling waits for the next submit or flush, while `masks` fills on a thread (rank 0);
    # rank 0 keeps every sampled step's masks (its timings go into the StepResult)
    deferred: bool = False
    masks: PendingMasks | None = None
    sampled: torch.Tensor | None = None              # [S] int64 on the device, once sampled
    host: SampledTensors | None = None               # host copies of the draw
    host_prompt: list[tuple[int, LogprobTensors]] = field(default_factory=list)
    forward_done: torch.cuda.Event | None = None     # CUDA: recorded after the logits
    done: torch.cuda.Event | None = None             # CUDA: recorded after the copies to the host
    # the draw as read on the host (tokens, logprobs, tokens per sequence), and the proposals
    read: tuple[list[int], list, list[int]] | None = None
    proposals: list[list[int]] = field(default_factory=list)
    propose_time_s: float = 0.0


class StepDraw:
    def __init__(self, sampler: Sampler, structured: StructuredOutputMasks | None,
                 proposer: Proposer | None, drafter: ModelProposer | None, slots: dict,
                 block_size: int, device: torch.device):
        self.sampler = sampler
        self.structured = structured   # rank 0 of the last stage only
        self.proposer = proposer       # n-gram or draft model: guesses after a step is read
        self.drafter = drafter         # draft_model: its draft probabilities for verification
        self.slots = slots             # the runner's (slot id -> Slot), rolled back on rejection
        self.block_size = block_size
        self.device = device

    def sample(self, st: Launched) -> None:
        """Queue the sampling of a launched step and the copies of its results to the host."""
        num = len(st.states)
        rank0 = tp_rank() == 0
        st.deferred = False
        if st.drafts is not None:
            num = self._verify(st, rank0)
        elif num:
            if rank0:
                if st.masks is None:
                    st.masks = self.structured.fill(st.states, later=False)
                allowed = st.masks.get()
                drawn = self.sampler.sample_tensors(st.logits[:num], st.states, allowed)
            else:
                drawn = SampledTensors(torch.empty(num, dtype=torch.long, device=self.device),
                                       [], None)
            # NOTE: only rank 0 samples; the others take its tokens so their slots stay in step.
            st.sampled = broadcast_tensor(drawn.token_ids)
            drawn.token_ids = st.sampled
            st.host = drawn.to_host()
        offset = num
        for slot_id, targets, k in st.prompt_rows if rank0 else []:
            part = st.logits[offset:offset + len(targets)]
            st.host_prompt.append(
                (slot_id, self.sampler.prompt_logprob_tensors(part, targets, k).to_host()))
            offset += len(targets)
        st.logits = None
        if self.device.type == "cuda":
            st.done = torch.cuda.Event()
            st.done.record()
        if st.propose and self.drafter is not None:
            # NOTE: a draft model guesses with its own steps right after the target's: the step
            # is read here (the scheduler plans nothing meanwhile). N-gram lookups wait until
            # the step is read anyway, with the next one in flight (`result`).
            self._propose(st)

    def _propose(self, st: Launched) -> None:
        """Guess the tokens after those a step drew (read on the host first)."""
        self.read(st)
        t0 = time.perf_counter()
        # NOTE: a thought's guesses may end it; the rows after its end are masked
        # (GrammarCompiler.fill_bitmask walks them)
        st.proposals = self.proposer.propose(st.sample_slots, st.states)
        st.propose_time_s = time.perf_counter() - t0
        st.propose = False

    def _verify(self, st: Launched, rank0: bool) -> int:
        """Queue the verification of a step with guesses (spec/verify.py); returns its number
        of sampling rows."""
        rows = sum(len(d) + 1 for d in st.drafts)
        if rank0:
            q = (self.drafter.draft_probs(st.sample_slots, st.drafts, st.states)
                 if self.drafter is not None else None)
            first_rows = list(itertools.accumulate((len(d) + 1 for d in st.drafts[:-1]),
                                                   initial=0))
            st.masks = self.structured.fill(st.states, first_rows, later=False,
                                            drafts=st.drafts)
            allowed = st.masks.get()
            v = verify(self.sampler, st.logits[:rows], st.states, st.drafts, q, allowed)
            drawn = SampledTensors(v.token_ids, v.logprob_rows, v.logprobs)
        else:
            drawn = SampledTensors(torch.empty(rows, dtype=torch.long, device=self.device), [],
                                   None)
        # NOTE: only rank 0 draws; every rank appends its tokens and rolls back alike
        drawn.token_ids = broadcast_tensor(drawn.token_ids)
        st.host = drawn.to_host()
        return rows

    def read(self, st: Launched) -> None:
        """Read a step's draw on the host (waiting for its copies) and append the tokens to
        their sequences, once. With guesses, a sequence gains its accepted guesses and one
        more, and its KV past them is dropped: its position goes back, and block-table entries
        past its last computed token (the scheduler frees the same blocks)."""
        if st.read is not None:
            return
        if st.done is not None:
            st.done.synchronize()
        out = st.host.output() if st.host is not None else None
        tokens, logprobs = (out.token_ids, out.logprobs) if out else ([], [])
        if st.drafts is None:
            for state, token in zip(st.states, tokens):
                state.token_ids.append(token)
                if state.grammar is not None:
                    state.grammar.accept(token)
            st.read = (tokens, logprobs, [])
            return
        kept, kept_lp, counts, row = [], [], [], 0
        for state, drafts, a, slot_id in zip(st.states, st.drafts,
                                             accepted_runs(tokens, st.drafts), st.sample_slots):
            new = tokens[row:row + a + 1]
            kept += new
            kept_lp += logprobs[row:row + a + 1]
            counts.append(a + 1)
            state.token_ids.extend(new)
            if state.grammar is not None:
                for token in new:
                    state.grammar.accept(token)
            slot = self.slots[slot_id]
            slot.num_computed -= len(drafts) - a
            slot.num_blocks = min(slot.num_blocks, -(-slot.num_computed // self.block_size))
            row += len(drafts) + 1
        st.read = (kept, kept_lp, counts)

    def result(self, st: Launched) -> StepResult:
        """The StepResult of a step (reading its draw if that is not done yet), with the
        guesses it asked for."""
        self.read(st)
        if st.propose:
            self._propose(st)
        tokens, logprobs, counts = st.read
        m = st.masks
        rows, fill_s, wait_s = (m.num_rows, m.fill_s, m.wait_s) if m else (0, 0.0, 0.0)
        return StepResult(step=st.step, sampled=tokens, logprobs=logprobs,
                          prompt_logprobs=[(slot, lp.tolist()) for slot, lp in st.host_prompt],
                          num_sampled=counts, proposals=st.proposals,
                          propose_time_s=st.propose_time_s, mask_rows=rows,
                          mask_fill_s=fill_s, mask_wait_s=wait_s)
