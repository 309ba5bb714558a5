"""Scheduling policies on the fake worker (tests/scheduler_util.py): exact admission and preemption
order of priority, deadline and length-aware, the fairness guard, latency objectives counted,
admission control sized from the pool, loading a policy by name, and docs/SCHEDULING.md's
custom-policy example run as written."""
from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import msgpack
import pytest
from scheduler_util import DEPTHS, Harness, prompts, reference

from conveyor.scheduler import (
    DeadlinePolicy,
    FCFSPolicy,
    LengthAwarePolicy,
    PriorityPolicy,
    Request,
    SchedulingContext,
    make_policy,
)
from conveyor.shared.messages import MessageError, decode, encode
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def running_ids(h: Harness) -> list[str]:
    return sorted(r.id for r in h.sched.running)


def admitted(h: Harness, plan) -> list[str]:
    by_slot = {r.slot: r.id for r in h.sched.running}
    return [by_slot[n.slot] for n in plan.new]


def step_until_admitted(h: Harness, rid: str, max_steps: int = 5):
    """Step until `rid` is admitted; returns that plan."""
    for _ in range(max_steps):
        plan = h.step()
        if plan is not None and rid in admitted(h, plan):
            return plan
    raise AssertionError(f"{rid} was not admitted in {max_steps} steps")


# --- priority ---------------------------------------------------------------------------------

@DEPTHS
def test_priority_admits_lower_numbers_first_then_by_arrival(depth):
    h = Harness(max_num_seqs=1, scheduling_policy="priority", depth=depth)
    for rid, priority in [("low", 5), ("high", -1), ("mid", 0), ("mid2", 0)]:
        h.add(rid, [1, 2, 3], priority=priority, max_tokens=2)
    h.run()
    assert h.finished == ["high", "mid", "mid2", "low"]
    assert h.sched.num_preemptions == 0


@DEPTHS
def test_priority_preempts_the_lowest_then_latest_for_a_slot(depth):
    h = Harness(max_num_seqs=3, scheduling_policy="priority", depth=depth)
    low = dict(zip("abc", prompts(3, 6)))
    for rid, priority in [("a", 5), ("b", 6), ("c", 5)]:
        h.add(rid, low[rid], priority=priority, max_tokens=30)
    for _ in range(3):
        h.step()
    victims = []
    for rid in ("h1", "h2", "h3"):
        h.add(rid, [7, 8, int(rid[1])], priority=0, max_tokens=30)
        slots = {r.id: r.slot for r in h.sched.running}
        plan = step_until_admitted(h, rid, max_steps=1)
        (victim,) = set(slots) - set(running_ids(h))
        assert slots[victim] in plan.freed and victim in [r.id for r in h.sched.waiting]
        victims.append(victim)
    assert victims == ["b", "c", "a"]                  # lowest priority, then latest arrival
    h.add("h4", [4, 5], priority=0, max_tokens=3)      # equal priority: waits, preempts nobody
    for _ in range(3):
        h.step()
    assert "h4" in [r.id for r in h.sched.waiting] and h.sched.num_preemptions == 3
    out = h.run()
    assert all(c.finish_reason == "length" for c in out.values())
    for rid in "abc":                                  # recomputed, nothing lost
        assert out[rid].tokens == reference(low[rid], 30)
        assert out[rid].stats[-1].num_preemptions == 1


@DEPTHS
def test_priority_preempts_for_blocks(depth):
    # 12 blocks of 4: "low" holds 9 once it has 33 tokens; "high" needs 4 for its 13-token prompt
    h = Harness(num_blocks=12, block_size=4, budget=64, scheduling_policy="priority",
                depth=depth)
    h.add("low", list(range(1, 31)), priority=1, max_tokens=10)
    for _ in range(4):
        h.step()
    h.add("high", list(range(40, 53)), priority=0, max_tokens=4)
    step_until_admitted(h, "high")
    assert [r.id for r in h.sched.waiting] == ["low"] and h.sched.num_preemptions == 1
    out = h.run()
    assert out["low"].tokens == reference(list(range(1, 31)), 10)
    assert h.finished.index("high") < h.finished.index("low")


def test_fcfs_never_preempts_for_a_waiting_request():
    h = Harness(max_num_seqs=1)
    h.add("first", [1, 2], priority=9, max_tokens=5)
    h.step()
    h.add("urgent", [3, 4], priority=-9, ttft_slo=0.1, max_tokens=2)
    h.run()
    assert h.finished == ["first", "urgent"] and h.sched.num_preemptions == 0


# --- fairness guard ---------------------------------------------------------------------------

@DEPTHS
def test_an_overdue_request_goes_first_and_is_not_preempted(depth):
    h = Harness(max_num_seqs=1, scheduling_policy="priority", max_wait_s=5.0, step_s=1.0,
                depth=depth)
    h.add("old", [1, 2], priority=9, max_tokens=4)
    h.add("busy", [3, 4], priority=0, max_tokens=8)
    h.step()
    assert running_ids(h) == ["busy"]
    assert h.sched.stats().longest_wait_s == h.now - 10.0
    more = itertools.count()
    while "busy" not in h.finished:                   # high-priority work keeps coming
        h.add(f"hi{next(more)}", [5, 6], priority=0, max_tokens=8)
        h.step()
    assert h.now - 10.0 > 5.0
    step_until_admitted(h, "old")                     # overdue: it goes first...
    h.add("later", [7, 8], priority=0, max_tokens=2)
    for _ in range(3):                                # ...and keeps its slot
        h.step()
        assert "old" in running_ids(h) or "old" in h.finished
    h.run()
    assert h.finished.index("old") == 1 and h.sched.num_preemptions == 0


# --- deadline ---------------------------------------------------------------------------------

def make(rid: str, arrival: float, n_tokens: int = 10, index: int = 0, **options) -> Request:
    return Request(id=rid, token_ids=[1] * n_tokens, prompt_len=n_tokens,
                   sampling=SamplingParams(), arrival=arrival, arrival_index=index,
                   options=RequestOptions(**options))


def test_deadline_order_is_earliest_reachable_deadline_first():
    ctx = SchedulingContext(now=10.0, step_time_s=0.5, token_budget=100, num_running=0)
    reqs = [
        make("a", 9.0, index=0, ttft_slo=5.0),              # due 14.0
        make("b", 9.5, index=1, ttft_slo=2.0),              # due 11.5
        make("batch", 8.0, index=2),                        # no objective
        make("late", 8.0, index=3, ttft_slo=1.0),           # due 9.0: missed already
        make("tight", 9.9, index=4, ttft_slo=0.3),          # due 10.2: one step ends at 10.5
        make("long", 9.8, 150, index=5, ttft_slo=1.2),      # due 11.0: two steps of 100 tokens
    ]
    order = [r.id for r in DeadlinePolicy().order_waiting(reqs, ctx)]
    assert order == ["long", "b", "a", "batch", "late", "tight"]
    # at 1.5 s a step only "b" and "a" are reachable; the rest go by arrival
    slow = SchedulingContext(now=10.0, step_time_s=1.5, token_budget=100, num_running=0)
    assert [r.id for r in DeadlinePolicy().order_waiting(reqs, slow)] == [
        "b", "a", "batch", "late", "long", "tight"]
    # 60 decodes running leave 40 tokens a step: "long" needs 4 steps of 0.25 s, just in time
    busy = SchedulingContext(now=10.0, step_time_s=0.25, token_budget=100, num_running=60)
    assert [r.id for r in DeadlinePolicy().order_waiting(reqs, busy)] == [
        "long", "b", "a", "batch", "late", "tight"]


def test_deadline_of_a_preempted_request_follows_its_tpot():
    r = make("r", 0.0, tpot_slo=0.5, ttft_slo=1.0)
    assert r.due() == 1.0
    r.stats.first_token = 2.0
    r.token_ids += [5, 6, 7]                        # 3 output tokens: the 4th is due at 2 + 3 * 0.5
    assert r.due() == 3.5
    done = make("y", 0.0, ttft_slo=1.0)
    done.stats.first_token = 0.5
    assert done.due() is None                       # first token out, no TPOT objective


@DEPTHS
@pytest.mark.parametrize("policy", ["fcfs", "deadline"])
def test_deadline_preempts_work_without_objectives_and_meets_them(policy, depth):
    # 2 slots, 0.1 s a step: "batch" (no objective) and "stream" (a TPOT objective) run; "chat"
    # wants its first token within 0.35 s
    h = Harness(max_num_seqs=2, scheduling_policy=policy, step_s=0.1, depth=depth)
    h.add("batch", prompts(1, 8)[0], max_tokens=30)
    h.add("stream", prompts(2, 8)[1], max_tokens=30, tpot_slo=0.5)
    for _ in range(3):
        h.step()
    h.add("chat", [9, 9, 9], max_tokens=3, ttft_slo=0.35)
    if policy == "deadline":
        plan = step_until_admitted(h, "chat", max_steps=1)
        assert [r.id for r in h.sched.waiting] == ["batch"]        # not "stream", a later arrival
        assert admitted(h, plan) == ["chat"]
    out = h.run()
    stats = h.sched.stats()
    assert (stats.ttft_slo_judged, stats.tpot_slo_judged, stats.tpot_slo_missed) == (1, 1, 0)
    assert stats.ttft_slo_missed == (policy == "fcfs")
    assert h.sched.num_preemptions == (policy == "deadline")
    assert out["batch"].tokens == reference(prompts(1, 8)[0], 30)


def test_objectives_are_judged_when_met_missed_or_abandoned():
    h = Harness(max_num_seqs=1, step_s=1.0)
    h.add("slow", [1, 2], max_tokens=4, tpot_slo=0.5)      # 1 s per token: a TPOT miss
    h.add("queued", [3, 4], max_tokens=2, ttft_slo=2.5)   # waits behind "slow": a TTFT miss
    h.add("gone", [5, 6], max_tokens=2, ttft_slo=100.0)   # cancelled before its deadline
    h.add("late_gone", [7], max_tokens=2, ttft_slo=0.5)   # cancelled after it: a miss
    for _ in range(2):
        h.step()
    h.collect(h.sched.abort(["gone", "late_gone"]))
    h.run()
    s = h.sched.stats()
    assert (s.ttft_slo_judged, s.ttft_slo_missed) == (2, 2)
    assert (s.tpot_slo_judged, s.tpot_slo_missed) == (1, 1)


# --- length-aware -----------------------------------------------------------------------------

@DEPTHS
def test_length_aware_groups_similar_prompts_shortest_first(depth):
    h = Harness(budget=64, num_blocks=128, scheduling_policy="length-aware", depth=depth)
    lengths = {"long30": 30, "s5": 5, "long20": 20, "s7": 7, "s6": 6, "one": 1}
    for rid, n in lengths.items():
        h.add(rid, prompts(1, n)[0], max_tokens=2)
    news = [admitted(h, h.step()) for _ in range(3)]
    assert news == [["one"], ["s5", "s7", "s6"], ["long30", "long20"]]   # 17-32 tokens together
    h.run()


def test_length_aware_lets_a_long_prompt_wait_at_most_max_wait_s():
    h = Harness(budget=16, max_num_seqs=2, scheduling_policy="length-aware", max_wait_s=3.0,
                step_s=1.0)
    h.add("long", prompts(1, 40)[0], max_tokens=2)
    admitted_at = None
    for t in range(8):                                 # a short prompt every step
        h.add(f"short{t}", [t + 1, 2], max_tokens=2)
        plan = h.step()
        if plan is not None and "long" in admitted(h, plan):
            admitted_at = t
            break
    assert admitted_at is not None and 3 <= h.now - 10.0 <= 5
    h.run()


# --- admission control from the pool ----------------------------------------------------------

def test_queue_cap_follows_the_pool_and_the_lengths_seen():
    # 32 blocks of 4, 8 slots: 8-token prompts (2 blocks) fit 16 at once, so 8 slots bind: cap 64
    h = Harness(num_blocks=32, max_num_seqs=8, budget=256, derive_queue_cap=True)
    h.add("p", list(range(8)), max_tokens=24)
    assert h.sched.stats().queue_cap == 64
    h.run()                                            # 8 + 24 tokens = 8 blocks: 4 fit: cap 32
    assert h.sched.stats().queue_cap == 32
    for i in range(32 + 8):                            # 8 take the slots at the next step
        h.add(f"r{i}", list(range(i, i + 8)), max_tokens=24)
    h.add("over", [1, 2, 3], max_tokens=2)
    assert h.out["over"].finish_reason == "error" and "32 requests" in h.out["over"].error
    capped = Harness(num_blocks=32, derive_queue_cap=True, max_queued_requests=5)
    capped.add("p", [1, 2, 3])
    assert capped.sched.stats().queue_cap == 5
    offline = Harness(num_blocks=32)                  # the offline API queues everything
    offline.add("p", [1, 2, 3])
    assert offline.sched.stats().queue_cap is None


@DEPTHS
def test_admission_reserves_blocks_for_the_expected_output(depth):
    # 24 blocks of 4 hold 3 requests of 8 + 24 tokens: once one such length is seen, no more run
    # at once, and nobody is preempted
    h = Harness(num_blocks=24, max_num_seqs=8, budget=64, depth=depth)
    h.add("first", list(range(8)), max_tokens=24)
    h.run()
    most = 0
    for i in range(6):
        h.add(f"r{i}", list(range(10 * i, 10 * i + 8)), max_tokens=24)
    while h.busy():
        most = max(most, h.sched.num_running)
    assert most == 3 and h.sched.num_preemptions == 0
    blind = Harness(num_blocks=24, max_num_seqs=8, budget=64, depth=depth)
    for i in range(6):
        blind.add(f"r{i}", list(range(10 * i, 10 * i + 8)), max_tokens=24)
    blind.run()
    assert blind.sched.num_preemptions > 0             # nothing seen yet: it admits all


@pytest.mark.parametrize("policy", ["fcfs", "deadline", "length-aware"])
def test_a_priority_the_policy_ignores_is_refused(policy):
    """Only the priority policy (or one of one's own) reads `priority`: elsewhere a non-zero one
    ends its request at once with a 400 naming the option, and 0 runs."""
    h = Harness(scheduling_policy=policy)
    h.add("urgent", [1, 2, 3], priority=-1)
    h.add("plain", [1, 2, 3], priority=0, max_tokens=2)
    h.run()
    assert h.out["urgent"].finish_reason == "error" and h.out["urgent"].tokens == []
    assert "--scheduling-policy priority" in h.out["urgent"].error
    assert h.out["plain"].finish_reason == "length"
    assert not h.sched.requests
    assert make_policy("priority").reads_priority


# --- loading policies and objectives on the wire ----------------------------------------------

def test_make_policy_by_name_and_module_path():
    assert isinstance(make_policy("fcfs"), FCFSPolicy)
    assert isinstance(make_policy("priority"), PriorityPolicy)
    assert isinstance(make_policy("length-aware"), LengthAwarePolicy)
    assert isinstance(make_policy("conveyor.scheduler.policy:DeadlinePolicy"), DeadlinePolicy)
    for name, message in [("lifo", "must be one of"), ("no_such_module:X", "cannot load"),
                          ("conveyor.scheduler:Nope", "cannot load"),
                          ("conveyor.scheduler:Request", "not a subclass")]:
        with pytest.raises(ValueError, match=message):
            make_policy(name)


def test_the_custom_policy_of_the_guide_runs(tmp_path, monkeypatch):
    """docs/SCHEDULING.md's example, written to my_policies.py and loaded by name."""
    guide = (ROOT / "docs" / "SCHEDULING.md").read_text()
    code = re.search(r"```python\n(# my_policies\.py\n.*?)```", guide, re.S).group(1)
    (tmp_path / "my_policies.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    h = Harness(max_num_seqs=1, scheduling_policy="my_policies:FewestTokensFirst")
    for rid, n in [("long", 12), ("short", 2), ("mid", 6)]:
        h.add(rid, [1, 2, 3], max_tokens=n)
    h.run()
    assert h.finished == ["short", "mid", "long"]


def test_objectives_must_be_positive_seconds():
    ok = GenerateRequest(id="a", prompt="x", options=RequestOptions(ttft_slo=0.5, tpot_slo=0.05))
    assert decode(encode(ok)) == ok
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttft_slo must be a positive number"):
            RequestOptions(ttft_slo=bad)
        with pytest.raises(MessageError, match="tpot_slo"):
            decode([encode(ok)[0], msgpack.packb({"id": "a", "prompt": "x",
                                                  "options": {"tpot_slo": bad}})])


@pytest.mark.parametrize("policy", ["priority", "deadline", "length-aware"])
@pytest.mark.parametrize("seed", range(3))
@DEPTHS
def test_random_workloads_keep_integrity_and_outputs(policy, seed, depth):
    """Priorities, objectives, a pool small enough to preempt, a short max_wait_s, aborts: every
    plan passes the worker's and check_integrity()'s checks, and what is not aborted equals the
    reference, whatever was preempted for whom."""
    rng = random.Random(seed)
    h = Harness(num_blocks=16, block_size=4, budget=rng.choice([8, 32]), max_num_seqs=4,
                max_model_len=40, scheduling_policy=policy, max_wait_s=2.0, step_s=0.1,
                depth=depth)
    prompts_by_id, arrivals = {}, {}
    for i in range(14):
        arrivals.setdefault(rng.randrange(30), []).append(f"r{i}")
        prompts_by_id[f"r{i}"] = [rng.randrange(1000) for _ in range(rng.randint(1, 16))]
    aborts = {rng.randrange(40): f"r{rng.randrange(14)}" for _ in range(2)}
    for t in range(10_000):
        for rid in arrivals.get(t, []):
            max_tokens, priority = rng.choice([1, 4, 12]), rng.randrange(3)
            # the other policies refuse a priority they ignore
            h.add(rid, prompts_by_id[rid], max_tokens=max_tokens,
                  priority=priority if policy == "priority" else 0,
                  ttft_slo=rng.choice([None, 0.3, 2.0]),
                  tpot_slo=rng.choice([None, 0.2]))
        if t in aborts:
            h.collect(h.sched.abort([aborts[t]]))
        if not h.busy() and t > 40:
            break
    out = h.run()
    assert h.sched.num_preemptions > 0 or policy == "length-aware"
    for rid, c in out.items():
        if c.finish_reason != "abort":
            assert c.tokens == reference(prompts_by_id[rid], len(c.tokens))


def test_a_request_sends_only_the_options_it_sets():
    """Options left at their defaults stay off the wire: a field the server does not know is
    refused (GenerateRequest and RequestOptions forbid unknown fields)."""
    body = msgpack.unpackb(encode(GenerateRequest(id="a", prompt="x"))[1])
    assert body == {"id": "a", "prompt": "x", "sampling": {}, "options": {}}
    ask = GenerateRequest(id="a", prompt="x", options=RequestOptions(ttft_slo=0.5))
    body = msgpack.unpackb(encode(ask)[1])
    assert body == {"id": "a", "prompt": "x", "sampling": {}, "options": {"ttft_slo": 0.5}}
