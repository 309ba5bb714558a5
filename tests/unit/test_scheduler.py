"""Scheduler: batching, chunked prefill, preemption, aborts, stops and prompt logprobs, with one
plan in flight (depth 1) or two (async scheduling, depth 2), on the fake worker of
tests/scheduler_util.py.
"""
from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import pytest
from scheduler_util import (
    DEPTHS,
    VOCAB,
    Harness,
    plus_one,
    prompts,
    reference,
)

from conveyor.scheduler import FCFSPolicy, IntegrityError, Policy, Request, SchedulingContext
from conveyor.scheduler.checks import AUDIT_INTERVAL_S
from conveyor.shared.messages.worker import StepResult
from conveyor.shared.sampling_params import SamplingParams


def test_scheduler_imports_no_torch():
    code = ("import sys, conveyor.scheduler.scheduler; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@DEPTHS
def test_token_budget_is_respected_and_filled(depth):
    h = Harness(budget=16, depth=depth)
    for i, p in enumerate(prompts(6, 13)):
        h.add(f"r{i}", p)
    h.run()
    totals = [sum(s.num_tokens for s in p.seqs) for p in h.worker.plans]
    assert max(totals) == 16                      # the worker asserts <= 16 on every plan
    assert any(1 in [s.num_tokens for s in p.seqs] and any(s.num_tokens > 1 for s in p.seqs)
               for p in h.worker.plans), "prefill and decode never shared a batch"
    assert all(len(c.tokens) == 8 and c.finish_reason == "length" for c in h.out.values())


@DEPTHS
def test_chunked_prefill_splits_a_long_prompt(depth):
    h = Harness(budget=16, block_size=4, depth=depth)
    prompt = list(range(1, 41))
    h.add("a", prompt, max_tokens=3)
    out = h.run()
    plans = h.worker.plans
    assert [[(s.num_tokens, s.sample) for s in p.seqs] for p in plans] == [
        [(16, False)], [(16, False)], [(8, True)], [(1, True)], [(1, True)]]
    assert [len(p.new) for p in plans] == [1, 0, 0, 0, 0]
    assert len(plans[0].new[0].block_ids) == 4 and plans[0].new[0].num_computed == 0
    assert [len(p.seqs[0].new_block_ids) for p in plans[1:]] == [4, 2, 1, 0]
    assert out["a"].tokens == reference(prompt, 3)


@DEPTHS
def test_decodes_are_scheduled_before_prefill_chunks(depth):
    h = Harness(budget=10, depth=depth)
    h.add("a", [1, 2, 3], max_tokens=5)
    h.step()
    h.add("b", list(range(10, 40)), max_tokens=2)
    plan = h.step()
    assert [(s.num_tokens, s.sample) for s in plan.seqs] == [(1, True), (9, False)]
    assert [n.slot for n in plan.new] == [1] and plan.seqs[1].slot == 1
    out = h.run()
    assert out["a"].tokens == reference([1, 2, 3], 5)
    assert out["b"].tokens == reference(list(range(10, 40)), 2)


@DEPTHS
def test_single_token_admissions_go_before_prefill_chunks(depth):
    h = Harness(budget=10, depth=depth)
    h.add("long", list(range(10, 25)), max_tokens=2)
    h.step()                                      # 10 of 15 prompt tokens
    h.add("one", [7], max_tokens=2)
    plan = h.step()
    assert [(s.slot, s.num_tokens) for s in plan.seqs] == [(1, 1), (0, 5)]
    h.run()


class FirstCandidate(FCFSPolicy):
    """Preempts the first candidate: the scheduler must offer only requests not yet planned."""

    def pick_victim(self, candidates):
        return candidates[0]


@DEPTHS
def test_max_num_seqs_caps_the_batch(depth):
    h = Harness(max_num_seqs=2, budget=64, depth=depth)
    for i, p in enumerate(prompts(5)):
        h.add(f"r{i}", p, max_tokens=4)
    running = []
    while h.busy():
        running.append(h.sched.num_running)
    assert max(running) == 2
    assert all(s.slot in (0, 1) for p in h.worker.plans for s in p.seqs)
    h.run()
    assert all(c.finish_reason == "length" for c in h.out.values())


@DEPTHS
def test_fcfs_admits_by_arrival_time(depth):
    h = Harness(max_num_seqs=1, depth=depth)
    h.add("late", [1, 2], arrival=3.0, max_tokens=2)
    h.add("early", [3, 4], arrival=1.0, max_tokens=2)
    h.add("middle", [5, 6], arrival=2.0, max_tokens=2)
    finished = []
    while h.busy():
        finished += [rid for rid, c in h.out.items() if c.num_finishes and rid not in finished]
    assert finished == ["early", "middle", "late"]


def test_fcfs_victim_is_the_latest_arrival():
    reqs = [Request(id=str(i), token_ids=[1], prompt_len=1, sampling=SamplingParams(),
                    arrival=a, arrival_index=i) for i, a in enumerate([2.0, 5.0, 5.0, 1.0])]
    ctx = SchedulingContext(now=6.0, step_time_s=0.0, token_budget=32, num_running=0)
    assert FCFSPolicy().pick_victim(reqs).id == "2"
    assert [r.id for r in FCFSPolicy().order_waiting(reqs, ctx)] == ["3", "0", "1", "2"]


class Recording(Policy):
    """Another policy's choices, recording each victim's pending tokens."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.victim_pending: list[int] = []

    def order_waiting(self, waiting, ctx):
        return self.inner.order_waiting(waiting, ctx)

    def pick_victim(self, candidates):
        victim = self.inner.pick_victim(candidates)
        self.victim_pending.append(victim.num_pending_tokens)
        return victim


@DEPTHS
@pytest.mark.parametrize("caching, policy", [(True, FCFSPolicy), (False, FCFSPolicy),
                                             (True, FirstCandidate)])
def test_preemption_gives_the_same_outputs(caching, policy, depth):
    ps = prompts(6, 11, shared=4)
    outs = []
    for num_blocks in (200, 10):
        recording = Recording(policy())
        h = Harness(num_blocks=num_blocks, block_size=4, budget=24, caching=caching,
                    policy=recording, depth=depth)
        for i, p in enumerate(ps):
            h.add(f"r{i}", p, max_tokens=20)
        outs.append(h.run())
        if num_blocks == 10:
            assert h.sched.num_preemptions > 0
            # at depth 2 some victims have a token in flight, which they keep
            assert max(recording.victim_pending) == depth - 1
            assert h.sched.stats().num_preemptions == h.sched.num_preemptions
            assert any(c.stats[-1].num_preemptions for c in h.out.values())
            resumed = [n for p in h.worker.plans for n in p.new if len(n.token_ids) > n.prompt_len]
            assert resumed and all(n.prompt_len == 11 for n in resumed)
    assert {k: c.tokens for k, c in outs[0].items()} == {k: c.tokens for k, c in outs[1].items()}
    assert all(len(c.tokens) == 20 for c in outs[1].values())


@DEPTHS
def test_prefix_cache_hit_skips_cached_blocks(depth):
    h = Harness(block_size=4, depth=depth)
    prompt = list(range(1, 21))                   # 5 full blocks
    h.add("a", prompt)
    h.run()
    h.add("b", prompt)
    plan = h.step()
    assert plan.new[0].num_computed == 16         # the last block is recomputed
    assert plan.seqs[0].num_tokens == 4
    h.run()
    assert h.out["b"].tokens == h.out["a"].tokens
    assert h.out["b"].stats[-1].num_cached_tokens == 16
    stats = h.sched.stats()
    assert stats.prefix_cache_hits == 16 and stats.prefix_cache_queries == 40


@DEPTHS
def test_abort_frees_everything_and_ends_once(depth):
    h = Harness(max_num_seqs=2, budget=8, depth=depth)
    for i, p in enumerate(prompts(4, 12)):
        h.add(f"r{i}", p, max_tokens=50)
    h.step()
    h.step()
    slot = next(r.slot for r in h.sched.running if r.id == "r0")
    h.collect(h.sched.abort(["r0", "r3", "nope"]))
    h.collect(h.sched.abort(["r0"]))              # already ended: ignored
    assert h.out["r0"].finish_reason == "abort" and h.out["r3"].finish_reason == "abort"
    h.sched.check_integrity()
    plan = h.step()
    assert slot in plan.freed
    h.collect(h.sched.abort(["r1"], reason="stop"))
    assert h.out["r1"].finish_reason == "stop"
    h.run()
    assert all(c.num_finishes == 1 for c in h.out.values()) and len(h.out) == 4


def test_abort_while_a_step_is_in_flight():
    h = Harness()
    h.add("a", [1, 2, 3], max_tokens=5)
    h.add("b", [4, 5, 6], max_tokens=5)
    result = h.worker.step(h.sched.schedule())
    h.collect(h.sched.abort(["a"]))
    outs = h.sched.update(result)
    assert [o.id for o in outs] == ["b"]
    h.collect(outs)
    assert h.step().freed == [0]
    h.run()
    assert h.out["a"].tokens == [] and h.out["a"].finish_reason == "abort"


@DEPTHS
def test_stop_on_eos(depth):
    h = Harness(eos=(8,), next_token=plus_one, depth=depth)
    h.add("a", [5], max_tokens=10)
    h.add("ignore", [5], max_tokens=5, ignore_eos=True)
    out = h.run()
    assert out["a"].tokens == [6, 7, 8]
    assert (out["a"].finish_reason, out["a"].stop_reason) == ("stop", None)
    assert out["ignore"].tokens == [6, 7, 8, 9, 0] and out["ignore"].finish_reason == "length"


@DEPTHS
def test_stop_token_ids_and_min_tokens(depth):
    h = Harness(eos=(8,), next_token=plus_one, depth=depth)
    h.add("stop_id", [5], max_tokens=10, stop_token_ids=[7])
    h.add("min_ok", [5], max_tokens=10, min_tokens=3)
    h.add("min_skips", [5], max_tokens=20, min_tokens=5, stop_token_ids=[9])
    out = h.run()
    assert out["stop_id"].tokens == [6, 7] and out["stop_id"].stop_reason == 7
    assert out["min_ok"].tokens == [6, 7, 8] and out["min_ok"].finish_reason == "stop"
    # 8 (eos) and 9 (stop id) are the 3rd and 4th tokens, before min_tokens; the next 8 ends it.
    assert out["min_skips"].tokens == [6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert out["min_skips"].finish_reason == "stop"
    # the sampler draws an end token below min_tokens only where allowed_token_ids (or a
    # grammar) leave nothing else: that one ends the request
    h = Harness(eos=(8,), next_token=plus_one, depth=depth)
    h.add("dead_end", [6], max_tokens=10, min_tokens=5, allowed_token_ids=[8])
    assert h.run()["dead_end"].tokens == [7, 8]


@DEPTHS
def test_length_limits(depth):
    h = Harness(next_token=plus_one, max_model_len=8, depth=depth)
    h.add("max_tokens", [1], max_tokens=3)
    h.add("context", [1, 2, 3, 4, 5], max_tokens=None)
    out = h.run()
    assert out["max_tokens"].tokens == [2, 3, 4] and out["max_tokens"].finish_reason == "length"
    assert out["context"].tokens == [6, 7, 8] and out["context"].finish_reason == "length"
    small_pool = Harness(next_token=plus_one, num_blocks=2, block_size=4, depth=depth)
    small_pool.add("a", [1, 2, 3], max_tokens=None)
    assert len(small_pool.run()["a"].tokens) == 5                # the pool holds 8 tokens


@DEPTHS
def test_requests_that_can_never_run_are_rejected(depth):
    h = Harness(num_blocks=4, block_size=4, max_model_len=20, depth=depth)
    h.add("ok", [1, 2, 3])
    h.add("ok", [1, 2])                                           # id in use
    h.add("empty", [])
    h.add("too_long", list(range(20)))
    h.add("pool", list(range(16)))                                # < 20, but 4 blocks hold 16
    assert [h.out[r].finish_reason for r in ("ok", "empty", "too_long", "pool")] == ["error"] * 4
    assert all(h.out[r].error for r in ("ok", "empty", "too_long", "pool"))
    assert h.sched.num_waiting == 1
    del h.out["ok"]
    out = h.run()
    assert out["ok"].finish_reason == "length"


@DEPTHS
@pytest.mark.parametrize("num_blocks, budget", [(200, 8), (12, 8), (200, 3)])
def test_prompt_logprobs_are_delivered_once(num_blocks, budget, depth):
    h = Harness(num_blocks=num_blocks, budget=budget, block_size=4, depth=depth)
    ps = prompts(4, 19, shared=8)
    h.add("plain", ps[0], max_tokens=12)                          # fills the prefix cache
    for i, p in enumerate(ps[1:]):
        h.add(f"lp{i}", p, max_tokens=12, prompt_logprobs=1, logprobs=0)
    out = h.run()
    if num_blocks == 12:
        assert h.sched.num_preemptions > 0
    for i, p in enumerate(ps[1:]):
        c = out[f"lp{i}"]
        assert [-e.logprobs[0] for e in c.prompt_logprobs] == list(range(1, 19))
        assert [e.token_ids[0] for e in c.prompt_logprobs] == p[1:]
        assert h.worker.prompt_positions[f"lp{i}"] == list(range(1, 19))   # none asked twice
        assert c.stats[0].num_cached_tokens == 0                  # skips the prefix cache
        assert len(c.logprobs) == len(c.tokens) == 12
    assert out["plain"].prompt_logprobs == [] and out["plain"].logprobs == []


def test_stats_are_sent_with_the_first_token_and_at_the_end():
    h = Harness()
    h.add("a", [1, 2, 3], max_tokens=4)
    outputs = []
    while (plan := h.sched.schedule()) is not None:
        outputs += h.sched.update(h.worker.step(plan))
    assert [o.stats is not None for o in outputs] == [True, False, False, True]
    assert outputs[0].stats.first_token >= outputs[0].stats.first_scheduled > 0


def test_protocol_misuse_is_rejected():
    h = Harness()
    h.add("a", [1, 2, 3])
    plan = h.sched.schedule()
    with pytest.raises(RuntimeError):
        h.sched.schedule()
    result = h.worker.step(plan)
    with pytest.raises(ValueError):
        h.sched.update(StepResult(plan.step + 1, result.sampled, result.logprobs, []))


def test_integrity_check_catches_a_leak():
    h = Harness()
    h.add("a", [1, 2, 3])
    h.step()
    h.sched.running[0].slot = None
    with pytest.raises(IntegrityError):
        h.sched.check_integrity()
    assert not h.sched.stats().integrity_ok


def test_audit_checks_when_idle_and_under_load_only_every_interval():
    """audit() (what a stats request runs): a full check each time the engine is idle; while it
    is busy, none within AUDIT_INTERVAL_S of the last, so a /metrics scrape stalls no step."""
    h = Harness()
    block = h.sched.blocks.blocks[0]
    block.ref_count = 1                               # held by no table: a leak
    h.sched.audit()
    assert not h.sched.stats().integrity_ok
    block.ref_count = 0
    h.sched.audit()                                   # idle: checked again at once
    assert h.sched.stats().integrity_ok
    h.add("a", [1, 2, 3], max_tokens=50)
    h.step()
    h.sched.running[0].slot = None                    # a leak the next full check finds
    h.sched.audit()                                   # busy, checked just now: skipped
    h.now += AUDIT_INTERVAL_S - 1
    h.sched.audit()
    assert h.sched.stats().integrity_ok
    h.now += 1
    h.sched.audit()                                   # the interval is up: checked
    assert not h.sched.stats().integrity_ok


# --- two plans in flight (async scheduling) -----------------------------------------------------

def count_frees(h: Harness) -> Counter:
    """Counts, per request id, the BlockManager.free calls that free blocks, from now on."""
    counts: Counter[str] = Counter()
    free = h.sched.blocks.free

    def counting(req):
        counts[req.id] += bool(req.block_table)
        free(req)
    h.sched.blocks.free = counting
    return counts


def test_ends_by_max_tokens_or_length_are_never_planned_past():
    h = Harness(next_token=plus_one, max_model_len=12, depth=2)
    h.add("one", [1], max_tokens=1)
    h.add("five", [1, 2], max_tokens=5)
    h.add("context", [1, 2, 3, 4, 5, 6, 7], max_tokens=None)      # 12 - 7 = 5 tokens
    out = h.run()
    assert h.max_pending == 2                                    # decoded a pending token
    assert h.worker.draws == {"one": 1, "five": 5, "context": 5}  # not one draw wasted
    assert out["one"].tokens == [2] and out["five"].tokens == [3, 4, 5, 6, 7]
    assert out["context"].tokens == [8, 9, 0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.values())


def test_a_stop_seen_late_drops_the_token_planned_after_it():
    h = Harness(eos=(8,), next_token=plus_one, depth=2)
    frees = count_frees(h)
    h.add("eos", [5], max_tokens=10)
    h.add("stop_id", [1], max_tokens=10, stop_token_ids=[4])
    h.add("long", [1], max_tokens=12, ignore_eos=True)            # keeps plans coming
    out = h.run()
    assert out["eos"].tokens == [6, 7, 8] and out["eos"].finish_reason == "stop"
    assert out["stop_id"].tokens == [2, 3, 4] and out["stop_id"].stop_reason == 4
    assert len(out["long"].tokens) == 12
    # the draw after each stop was planned before the stop was seen, and dropped
    assert h.worker.draws == {"eos": 4, "stop_id": 4, "long": 12}
    assert frees == {"eos": 1, "stop_id": 1, "long": 1}
    freed = [slot for p in h.worker.plans for slot in p.freed]
    assert sorted(freed) == [0, 1]                               # each slot freed once
    assert all(c.num_finishes == 1 for c in out.values())


def test_abort_with_two_steps_in_flight():
    h = Harness(depth=2)
    frees = count_frees(h)
    h.add("a", [1, 2, 3], max_tokens=5)
    h.add("b", [4, 5, 6], max_tokens=5)
    h.add("c", [7, 8, 9], max_tokens=2)
    for _ in range(2):
        h.worker.receive(h.sched.schedule())
    assert h.sched.num_in_flight == 2 and not h.sched.can_schedule()
    assert all(r.num_pending_tokens == 2 for r in h.sched.running)
    with pytest.raises(RuntimeError):
        h.sched.schedule()
    h.collect(h.sched.abort(["a", "c"]))
    h.sched.check_integrity()
    assert frees == {"a": 1, "c": 1}
    for _ in range(2):                        # both results come back: a and c get nothing
        h.collect(h.sched.update(h.worker.run_next()))
        h.sched.check_integrity()
    assert h.out["a"].tokens == [] and h.out["a"].finish_reason == "abort"
    assert h.out["c"].tokens == [] and h.out["c"].finish_reason == "abort"
    assert h.out["b"].tokens == reference([4, 5, 6], 2)
    assert h.step().freed == [0, 2]
    out = h.run()
    assert out["b"].tokens == reference([4, 5, 6], 5)
    assert frees == {"a": 1, "b": 1, "c": 1}


@pytest.mark.parametrize("case", ["kept", "self", "ends", "abort"])
def test_a_request_preempted_with_a_token_in_flight_keeps_it(case):
    # 4 blocks of 4: "a" and "b" fill them after one decode each. In the third plan "b" (the
    # latest arrival) is preempted while its second token is drawn: for the next decode of "a"
    # ("kept", "ends", "abort"), or for its own when "a" is not planned since its last token is
    # drawn ("self": nothing is planned; "b" waits for its token before it is readmitted).
    recording = Recording(FCFSPolicy())
    h = Harness(num_blocks=4, block_size=4, next_token=plus_one, policy=recording, depth=2)
    frees = count_frees(h)
    a, b = [1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8, 9]
    b_max = 2 if case == "ends" else 8
    h.add("a", a, max_tokens=2 if case == "self" else 8)
    h.add("b", b, max_tokens=b_max)
    while h.plan() is not None and not h.sched.num_preemptions:
        if h.sched.num_in_flight == 2:
            h.apply()
    req = next(r for r in h.sched.waiting if r.id == "b")
    assert req.num_pending_tokens == 1 and recording.victim_pending == [1]
    assert frees["b"] == 1 and len(h.out["b"].tokens) == 1
    if case == "abort":
        h.collect(h.sched.abort(["b"]))
        h.sched.check_integrity()
    h.apply()                                 # b's second token: kept unless aborted
    assert len(h.out["b"].tokens) == (1 if case == "abort" else 2)
    out = h.run()
    assert out["a"].tokens == reference(a, len(out["a"].tokens), plus_one)
    assert out["b"].tokens == reference(b, len(out["b"].tokens), plus_one)
    assert frees["b"] == 1 + (case in ("kept", "self"))
    if case == "abort":
        assert out["b"].finish_reason == "abort"
    else:
        assert len(out["b"].tokens) == b_max and out["b"].finish_reason == "length"
        assert out["b"].stats[-1].num_preemptions == 1


@DEPTHS
def test_generated_tokens_are_cached_once_known(depth):
    h = Harness(block_size=4, next_token=plus_one, depth=depth)
    h.add("a", [1, 2, 3, 4, 5], max_tokens=10)
    full = [1, 2, 3, 4, 5] + h.run()["a"].tokens               # 15 tokens
    h.add("b", full, max_tokens=1)
    h.run()
    assert h.out["b"].stats[-1].num_cached_tokens == 12          # all but the last block


def test_protocol_misuse_is_rejected_with_two_plans_in_flight():
    h = Harness(depth=2)
    h.add("a", [1, 2, 3])
    first, second = h.sched.schedule(), h.sched.schedule()
    with pytest.raises(RuntimeError):
        h.sched.schedule()
    h.worker.receive(first)
    h.worker.receive(second)
    r1, r2 = h.worker.run_next(), h.worker.run_next()
    with pytest.raises(ValueError):
        h.sched.update(r2)                    # results come back in plan order
    h.collect(h.sched.update(r1))
    h.collect(h.sched.update(r2))
    assert h.out["a"].tokens == reference([1, 2, 3], 2)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_give_the_same_outputs_at_depth_1_and_2(seed):
    """Stops by EOS, stop ids and lengths, min_tokens, prompt logprobs, a shared prefix, chunked
    prefill, a pool small enough to preempt, and aborts at random points."""
    rng = random.Random(seed)
    requests = []
    for i in range(12):
        prompt = list(range(500, 508))[:rng.choice([0, 8])] + [rng.randrange(VOCAB)
                                                              for _ in range(rng.randint(1, 20))]
        max_tokens = rng.choice([1, 2, 5, 16, None])
        sampling = dict(max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 3]),
                                                              max_tokens or 3),
                        stop_token_ids=rng.sample(range(VOCAB), 30) if rng.random() < 0.5 else [],
                        prompt_logprobs=1 if rng.random() < 0.3 else None)
        requests.append((f"r{i}", prompt, sampling, rng.randrange(40)))   # arrives at step
    aborts = {rng.randrange(40): f"r{rng.randrange(12)}" for _ in range(3)}
    outs = []
    for depth in (1, 2):
        h = Harness(num_blocks=14, block_size=4, budget=rng.choice([8, 32]), max_num_seqs=5,
                    eos=(3, 17, 101), max_model_len=40, depth=depth)
        for t in range(10_000):
            for rid, prompt, sampling, at in requests:
                if at == t:
                    h.add(rid, prompt, **sampling)
            if t in aborts:
                h.collect(h.sched.abort([aborts[t]]))
            if not h.busy() and t > 40:
                break
        out = h.run()
        assert depth == 1 or h.max_pending == 2
        outs.append(out)
    for rid, prompt, _, _ in requests:
        one, two = outs[0][rid], outs[1][rid]
        if "abort" in (one.finish_reason, two.finish_reason):
            continue                          # aborted at another point of its life
        assert (one.tokens, one.finish_reason, one.stop_reason) == (
            two.tokens, two.finish_reason, two.stop_reason)
        assert one.tokens == reference(prompt, len(one.tokens))
        assert one.prompt_logprobs == two.prompt_logprobs
