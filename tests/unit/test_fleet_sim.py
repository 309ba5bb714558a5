"""The fleet simulator (benchmarks/fleet/): its scheduler model plans the steps conveyor's
Scheduler plans, its latency and throughput follow the cost model, and conveyor's Router
decides as served. Deterministic (seeded), no torch, a few seconds in all."""
from __future__ import annotations

import math

import pytest

from benchmarks.fleet.cost import CostModel, StepShape, fit, part_features
from benchmarks.fleet.replica import Lane, Seq
from benchmarks.fleet.sim import Workload, simulate
from conveyor.scheduler import Scheduler
from conveyor.shared.config import EngineConfig
from conveyor.shared.messages.engine import AddRequest
from conveyor.shared.messages.worker import StepResult
from conveyor.shared.sampling_params import SamplingParams


def linear_cost(per_step=0.010, per_token=0.001, **kw) -> CostModel:
    """A step costs per_step plus per_token a token, nothing else."""
    args = dict(name="linear", knots=[(1, per_step + per_token), (2, per_step + 2 * per_token)],
                block_size=16, max_num_batched_tokens=512, max_num_seqs=32,
                async_scheduling=False, num_blocks=4096)
    return CostModel(**(args | kw))


# --- the scheduler model against conveyor's Scheduler -----------------------------------------

def _requests(n: int, seed: int, groups: int) -> tuple[list[Seq], Workload]:
    w = Workload(n, math.inf, (5, 90), (1, 12), prefix_groups=groups, prefix_len=40, seed=seed)
    return w.requests(16), w


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_blocks", [4096, 40])       # 40: preemptions and admission limits
@pytest.mark.parametrize("groups", [0, 3])
def test_lane_plans_the_steps_the_scheduler_plans(async_scheduling, num_blocks, groups):
    config = EngineConfig(block_size=16, max_num_batched_tokens=64, max_num_seqs=6,
                          async_scheduling=async_scheduling, enable_prefix_caching=True)
    sched = Scheduler(config, num_blocks, eos_token_ids=(2,), max_model_len=4096,
                      clock=lambda: 0.0)
    seqs, workload = _requests(40, seed=num_blocks + groups, groups=groups)
    lane = Lane(num_blocks, 16, 6, 64, async_scheduling)
    for s in seqs:
        sched.add(AddRequest(id=str(s.rid), token_ids=workload.prompt(s),
                             sampling=SamplingParams(max_tokens=s.out_len, ignore_eos=True),
                             arrival=s.arrival + s.rid * 1e-9))
        lane.add(s)
    real, model = [], []
    while sched.has_work() or sched.num_in_flight:
        while sched.can_schedule():
            if sched.schedule() is None:
                break
            real.append(sorted((p.req.id, p.end - p.step.num_tokens, p.step.num_tokens)
                               for p in sched._in_flight[-1][1]))
        while lane.can_plan():
            parts = lane.schedule()
            if parts is None:
                break
            model.append(sorted((str(p.seq.rid), p.start, p.num) for p in parts))
        assert model == real
        planned = sched._in_flight[0][1]
        n = sum(p.step.sample for p in planned)
        sched.update(StepResult(step=sched._in_flight[0][0], sampled=[5] * n,
                                logprobs=[None] * n, prompt_logprobs=[]))
        lane.update(0.0)
    assert not lane.running and not lane.waiting
    stats = sched.stats()
    assert (lane.pool.queries, lane.pool.hits) == (stats.prefix_cache_queries,
                                                   stats.prefix_cache_hits)
    assert lane.num_preemptions == stats.num_preemptions
    if num_blocks == 40:
        assert stats.num_preemptions or any(len(p) < 6 for p in real)


# --- latency and throughput -------------------------------------------------------------------

def test_a_lone_request_waits_one_prefill_step():
    cost = linear_cost(request_overhead_s=0.002)
    # a request every 100 s on average, each done in well under a second: each runs alone
    w = Workload(20, rate=0.01, input_len=(100, 300), output_len=(4, 4), seed=1)
    r = simulate(cost, w)
    # its TTFT is its prompt's step, plus the overhead
    expected = [cost.step_time(StepShape(s.prompt_len, 1, 0, part_features(0, s.prompt_len)[1]))
                + 0.002 for s in w.requests(16)]
    assert r.ttft_ms["mean"] == pytest.approx(1e3 * sum(expected) / len(expected), rel=1e-9)
    assert r.ttft_ms["p99"] <= 1e3 * max(expected) * (1 + 1e-9)


def test_throughput_saturates_at_the_cost_models_bound():
    # prompts of one token, long outputs: the steady step is 32 decodes, 10 + 32 ms
    cost = linear_cost()
    w = Workload(256, input_len=(1, 1), output_len=(200, 200))
    r = simulate(cost, w)
    bound = 32 / (0.010 + 32 * 0.001)
    assert r.saturated_tok_per_s == pytest.approx(bound, rel=0.02)
    assert r.tok_per_s <= bound * 1.001


def test_doubling_replicas_at_saturation_doubles_throughput():
    cost = linear_cost()
    one = simulate(cost, Workload(128, input_len=(20, 200), output_len=(20, 200)), dp=1,
                   policy="round_robin")
    two = simulate(cost, Workload(256, input_len=(20, 200), output_len=(20, 200)), dp=2,
                   policy="round_robin")
    assert two.saturated_tok_per_s / one.saturated_tok_per_s == pytest.approx(2.0, rel=0.05)


def test_overlap_hides_nothing_but_plans_ahead():
    """With overlap the next step is planned while one runs: a request arriving then waits
    for both, so a loaded replica's TTFT grows, its throughput does not."""
    w = Workload(200, rate=20, input_len=(20, 100), output_len=(20, 60), seed=3)
    sync = simulate(linear_cost(), w)
    overlap = simulate(linear_cost(async_scheduling=True), w)
    assert overlap.tok_per_s == pytest.approx(sync.tok_per_s, rel=0.05)
    assert overlap.ttft_ms["p50"] > sync.ttft_ms["p50"]


def test_tensor_and_pipeline_parallel_costs():
    cost = linear_cost(model=CostModel.load("h200-llama3.1-8b").model)
    shape = StepShape(256, 256, 0, 0.0)
    one, _ = cost.parallel_step(shape)
    tp2, _ = cost.parallel_step(shape, tp=2)
    assert one / 2 < tp2 < one                       # faster, not twice as fast
    stage, total = cost.parallel_step(shape, pp=2)
    assert stage == pytest.approx(total / 2) and total > one
    w = Workload(150, input_len=(20, 200), output_len=(20, 200))
    flat = simulate(cost, w, dp=1)
    piped = simulate(cost, w, dp=1, pp=2)            # two micro-batches keep both stages busy
    assert piped.saturated_tok_per_s > 1.2 * flat.saturated_tok_per_s
    # a lone request passes both stages: its first token takes the whole step and the hop
    lone = Workload(1, input_len=(100, 100), output_len=(2, 2))
    step = StepShape(100, 1, 0, part_features(0, 100)[1])
    assert simulate(cost, lone, pp=2).ttft_ms["p50"] == pytest.approx(
        1e3 * cost.parallel_step(step, pp=2)[1])


# --- routers ----------------------------------------------------------------------------------

def test_prefix_affinity_finds_more_of_the_shared_prefixes():
    # 64 prefixes of 16 blocks: all of them overflow a replica's 600 blocks, a quarter fits
    cost = linear_cost(num_blocks=600)
    w = Workload(600, rate=60, input_len=(20, 60), output_len=(5, 20), prefix_groups=64,
                 prefix_len=256, seed=2)
    rates = {p: simulate(cost, w, dp=4, policy=p).prefix_hit_rate
             for p in ("round_robin", "least_loaded", "prefix_affinity")}
    assert rates["prefix_affinity"] > 1.5 * max(rates["round_robin"], rates["least_loaded"]), \
        rates


def test_given_arrivals_replace_the_workloads_own():
    """A burst at once leaves affinity one step to find nothing cached; the same requests
    spread out (given arrivals, out of order) find their prefixes; the burst's own arrivals
    given back change nothing."""
    cost = linear_cost()
    w = Workload(48, input_len=(20, 40), output_len=(2, 4), prefix_groups=4, prefix_len=256)
    burst = simulate(cost, w, dp=2, policy="prefix_affinity")
    assert simulate(cost, w, dp=2, policy="prefix_affinity", arrivals=[0.0] * 48) == burst
    spread = simulate(cost, w, dp=2, policy="prefix_affinity",
                      arrivals=[0.5 * ((7 * i) % 48) for i in range(48)])
    assert spread.prefix_hit_rate > burst.prefix_hit_rate
    with pytest.raises(ValueError):
        simulate(cost, w, arrivals=[0.0] * 47)


def test_prefix_affinity_yields_to_the_least_loaded_past_the_threshold():
    # one prefix, every request: affinity alone would send all to one replica
    cost = linear_cost()
    w = Workload(200, input_len=(10, 20), output_len=(50, 50), prefix_groups=1,
                 prefix_len=128)
    r = simulate(cost, w, dp=4, policy="prefix_affinity")
    assert min(r.requests_per_replica) > 0
    assert max(r.requests_per_replica) < 200


# --- the cost model ---------------------------------------------------------------------------

def test_fit_recovers_the_costs_of_measured_steps():
    truth = CostModel(name="t", knots=[(1, 0.05), (64, 0.06), (1024, 0.9)], c_seq=2e-3,
                      c_kv=1e-6, c_attn=1e-9)
    shapes = [StepShape(t, s, k, a) for t, s, k, a in [
        (1, 1, 100, 0), (16, 16, 4000, 0), (64, 1, 0, 2080), (64, 64, 9000, 0),
        (256, 1, 0, 32896), (1024, 1, 0, 524800), (512, 1, 0, 131328), (300, 44, 8000, 40000),
        (128, 128, 20000, 0), (4, 4, 400, 0)]]
    samples = [(s, truth.step_time(s)) for s in shapes]
    knots, c_seq, c_kv, c_attn = fit(samples, knots=[1, 64, 1024])
    fitted = CostModel(name="f", knots=knots, c_seq=c_seq, c_kv=c_kv, c_attn=c_attn)
    for s in shapes:
        assert fitted.step_time(s) == pytest.approx(truth.step_time(s), rel=1e-6)


def test_cost_files_load_and_fill_a_replica():
    for name in ("h200-qwen3-0.6b", "h200-llama3.1-8b"):
        cost = CostModel.load(name)
        assert cost.replica_blocks() * cost.block_size > 256 * 2048
        assert cost.step_time(StepShape(256, 256, 256 * 1000, 0)) > cost.base(256)
    with pytest.raises(FileNotFoundError, match="built in"):
        CostModel.load("no-such-costs")


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        simulate(linear_cost(), Workload(1), policy="random")


def test_a_sampled_fleet_predicts_the_whole_one():
    """`table` simulates a large fleet as a few replicas with their share of the load."""
    import argparse

    from benchmarks.fleet.cli import fleet_row, layouts

    assert layouts(16, 8) == [(16, 1, 1), (8, 2, 1), (2, 8, 1), (1, 8, 2)]
    args = argparse.Namespace(input_len=(20, 100), output_len=(20, 100), seed=0, requests=50,
                              duration=40.0, prefix_groups=0, prefix_len=0, zipf=0.0,
                              policy="round_robin", max_num_seqs=8, max_num_batched_tokens=None,
                              no_prefix_caching=False, frontends=1)
    cost = linear_cost()
    whole = fleet_row(cost, 4, 1, 1, 5.0, args, max_replicas=4)
    sampled = fleet_row(cost, 4, 1, 1, 5.0, args, max_replicas=2)
    assert sampled["simulated replicas"] == 2
    assert sampled["saturated tok/s"] == pytest.approx(whole["saturated tok/s"], rel=0.05)
    assert sampled["TTFT p50 ms"] == pytest.approx(whole["TTFT p50 ms"], rel=0.2)
