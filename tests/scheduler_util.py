"""The scheduler's test bench: a fake worker that runs plans like a real one, and a harness that
drives a Scheduler with it (used by tests/unit/test_scheduler.py and test_policies.py).

A fake worker runs every plan: it keeps per-slot state from NewSeq/SeqStep/freed like a real one,
writes each computed token into a fake KV pool, and samples from the context it reads back from the
pool, so a wrong block table, a bad cache hit or a mis-planned range changes the output or fails.
At depth 2 it runs a plan as late as a real pipeline may: after the scheduler planned the next one
and applied the result before, so blocks freed meanwhile may already be planned for someone else.
The harness's clock stands still at `Harness.now` unless a test moves it. Under pipeline
parallelism (`pipeline_parallel_size` P, depth P) it also keeps what a stage that does not sample
knows of each slot (the NewSeq's tokens and every SeqStep's `token_ids`) and checks that it is
every token the step reads.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from conveyor.scheduler import Scheduler
from conveyor.shared.config import EngineConfig
from conveyor.shared.messages.engine import AddRequest, TokenOutput
from conveyor.shared.messages.worker import StepPlan, StepResult, TokenLogprobs
from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams

VOCAB = 1000


def context_token(ctx: list[int]) -> int:
    """The fake model: the next token depends on every token of the context and its position."""
    return sum((i + 1) * t for i, t in enumerate(ctx)) * 7919 % VOCAB


def plus_one(ctx: list[int]) -> int:
    return (ctx[-1] + 1) % 10


@dataclass
class SlotState:
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed: int


class FakeWorker:
    def __init__(self, sched: Scheduler, next_token=context_token) -> None:
        self.sched = sched
        self.next_token = next_token
        self.bs = sched.config.block_size
        self.pool: dict[tuple[int, int], int] = {}        # (block, offset) -> token id
        self.slots: dict[int, SlotState] = {}
        self.plans: list[StepPlan] = []
        self.queue: deque[tuple[StepPlan, dict]] = deque()   # received, not run yet
        self.prompt_positions: dict[str, list[int]] = {}   # request id -> positions returned
        self.draws: Counter[str] = Counter()               # request id -> tokens sampled for it
        self.stage_tokens: dict[int, list[int]] = {}       # slot -> tokens a first stage knows

    def _kv(self, st: SlotState, p: int) -> int | None:
        return self.pool.get((st.block_ids[p // self.bs], p % self.bs))

    def step(self, plan: StepPlan) -> StepResult:
        self.receive(plan)
        return self.run_next()

    def receive(self, plan: StepPlan) -> None:
        """Take a plan, with what the scheduler holds for it now (checked when it runs)."""
        cfg = self.sched.config
        assert not self.plans or plan.step == self.plans[-1].step + 1
        self.plans.append(plan)
        assert sum(s.num_tokens for s in plan.seqs) <= cfg.max_num_batched_tokens
        assert len(plan.seqs) <= cfg.max_num_seqs
        assert len({s.slot for s in plan.seqs}) == len(plan.seqs)
        single = [s.num_tokens == 1 for s in plan.seqs]
        assert single == sorted(single, reverse=True), "single-token steps must come first"
        by_slot = {r.slot: r for r in self.sched.running}
        blocks = self.sched.blocks.blocks
        # slot -> (request id, block table, blocks it alone holds)
        held = {s.slot: (by_slot[s.slot].id, list(by_slot[s.slot].block_table),
                         {b for b in by_slot[s.slot].block_table if blocks[b].ref_count == 1})
                for s in plan.seqs}
        self.queue.append((plan, held))

    def run_next(self) -> StepResult:
        """Run the oldest plan received."""
        plan, held = self.queue.popleft()
        cfg = self.sched.config
        for slot in plan.freed:
            del self.slots[slot]                          # KeyError: freed an unknown slot
        for ns in plan.new:
            assert 0 <= ns.slot < cfg.max_num_seqs and ns.slot not in self.slots
            assert ns.num_computed % self.bs == 0 and ns.num_computed < len(ns.token_ids)
            st = SlotState(list(ns.token_ids), ns.prompt_len, ns.sampling, list(ns.block_ids),
                           ns.num_computed)
            assert all(self._kv(st, p) == st.token_ids[p] for p in range(ns.num_computed))
            self.slots[ns.slot] = st
            self.stage_tokens[ns.slot] = list(ns.token_ids)
        sampled, logprobs, prompt_logprobs = [], [], []
        for s in plan.seqs:
            st = self.slots[s.slot]
            rid, table, private = held[s.slot]
            if any(ns.slot == s.slot for ns in plan.new):
                assert s.new_block_ids == []
            st.block_ids += s.new_block_ids
            assert st.block_ids == table
            if self.sched.pp > 1:
                self.stage_tokens[s.slot] += s.token_ids
                assert self.stage_tokens[s.slot] == st.token_ids, "a stage misses tokens"
            else:
                assert s.token_ids == []
            start, end = st.num_computed, st.num_computed + s.num_tokens
            assert s.num_tokens >= 1 and end <= len(st.token_ids)
            assert s.sample == (end == len(st.token_ids))
            assert len(st.block_ids) * self.bs >= end
            for p in range(start, end):
                block = st.block_ids[p // self.bs]
                assert block in private, "wrote a shared block"
                self.pool[(block, p % self.bs)] = st.token_ids[p]
            st.num_computed = end
            if s.prompt_logprobs_from >= 0:
                lo, hi = s.prompt_logprobs_from, min(end + 1, st.prompt_len)
                assert start + 1 <= lo < hi
                self.prompt_positions.setdefault(rid, []).extend(range(lo, hi))
                prompt_logprobs.append((s.slot, [TokenLogprobs([st.token_ids[p]], [-float(p)], 1)
                                                 for p in range(lo, hi)]))
            if s.sample:
                ctx = [self._kv(st, p) for p in range(end)]
                assert ctx == st.token_ids[:end]
                token = self.next_token(ctx)
                st.token_ids.append(token)
                sampled.append(token)
                self.draws[rid] += 1
                want = st.sampling.logprobs is not None
                logprobs.append(TokenLogprobs([token], [-0.5], 1) if want else None)
        return StepResult(plan.step, sampled, logprobs, prompt_logprobs)


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    stats: list = field(default_factory=list)
    num_finishes: int = 0


class Harness:
    """`policy`: a Policy, else config's scheduling_policy; `config`: more EngineConfig fields.
    Each result the worker returns takes step_s seconds of the harness's clock."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, budget=32, caching=True,
                 eos=(), max_model_len=256, next_token=context_token, policy=None,
                 depth=1, step_s=0.0, derive_queue_cap=False, **config) -> None:
        cfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=budget, enable_prefix_caching=caching,
                           async_scheduling=depth == 2, **config)
        self.now = 10.0
        self.step_s = step_s
        self.sched = Scheduler(cfg, num_blocks, eos, max_model_len, policy, derive_queue_cap,
                               clock=lambda: self.now)
        assert self.sched.max_in_flight == depth
        self.worker = FakeWorker(self.sched, next_token)
        self.out: dict[str, Collected] = {}
        self.max_pending = 0                  # most pending tokens any request had after a plan
        self.finished: list[str] = []         # request ids in the order they finished

    def add(self, rid: str, prompt, arrival: float | None = None, priority: int = 0,
            ttft_slo: float | None = None, tpot_slo: float | None = None, **sampling) -> None:
        """Queue a request arriving now (or at `arrival`); `sampling`: SamplingParams fields."""
        sampling.setdefault("max_tokens", 8)
        msg = AddRequest(id=rid, token_ids=list(prompt), sampling=SamplingParams(**sampling),
                         arrival=self.now if arrival is None else arrival,
                         options=RequestOptions(priority=priority, ttft_slo=ttft_slo,
                                                tpot_slo=tpot_slo))
        self.collect(self.sched.add(msg))

    def collect(self, outputs: list[TokenOutput]) -> None:
        for o in outputs:
            c = self.out.setdefault(o.id, Collected())
            assert c.num_finishes == 0, f"output for {o.id} after it finished"
            c.tokens += o.new_token_ids
            c.logprobs += o.logprobs or []
            c.prompt_logprobs += o.prompt_logprobs or []
            if o.stats is not None:
                c.stats.append(o.stats)
            if o.finish_reason is not None:
                c.num_finishes += 1
                self.finished.append(o.id)
                c.finish_reason, c.stop_reason, c.error = o.finish_reason, o.stop_reason, o.error

    def step(self) -> StepPlan | None:
        """Plan a step if one is due; then, with `depth` plans in flight or none planned, run the
        oldest and apply its result (as the process loops do). Returns the plan, if any."""
        plan = self.plan()
        if self.worker.queue and (plan is None
                                  or self.sched.num_in_flight == self.sched.max_in_flight):
            self.apply()
        return plan

    def plan(self) -> StepPlan | None:
        plan = self.sched.schedule() if self.sched.can_schedule() else None
        self.sched.check_integrity()
        if plan is not None:
            self.worker.receive(plan)
            self.max_pending = max([self.max_pending]
                                   + [r.num_pending_tokens for r in self.sched.running])
        return plan

    def apply(self) -> None:
        """Run the oldest plan in flight and apply its result."""
        result = self.worker.run_next()
        self.now += self.step_s
        self.collect(self.sched.update(result))
        self.sched.check_integrity()

    def busy(self) -> bool:
        """Plan or apply one step; False once there was nothing to do."""
        in_flight = bool(self.worker.queue)
        return self.step() is not None or in_flight

    def run(self, max_steps: int = 10_000) -> dict[str, Collected]:
        for _ in range(max_steps):
            if not self.busy():
                break
        assert not self.sched.has_work(), "nothing scheduled, yet requests remain"
        assert all(c.num_finishes == 1 for c in self.out.values())
        assert self.sched.blocks.num_free_blocks == self.sched.blocks.num_blocks
        return self.out


DEPTHS = pytest.mark.parametrize("depth", [1, 2])


def prompts(n: int, length: int = 10, shared: int = 0) -> list[list[int]]:
    return [list(range(500, 500 + shared)) + [(7 * i + j) % VOCAB for j in range(length - shared)]
            for i in range(1, n + 1)]


def reference(prompt: list[int], n: int, next_token=context_token) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]
