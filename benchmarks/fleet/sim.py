"""The fleet on paper: requests arrive, frontends route them to replicas, replicas run steps.

A discrete-event simulation. Events are arrivals and step ends. A request arrives at a frontend
(one drawn at random, as the kernel spreads connections over `conveyor serve --frontends`), whose
router picks its replica: conveyor/frontend/router.py's own Router, fed AddRequest messages
carrying the prompt's head tokens, and told of each finished request, so round_robin,
least_loaded and prefix_affinity (its rendezvous hash and its imbalance threshold) decide exactly
as served. A replica of tp x pp GPUs runs one Lane (pp = 1) or pp lanes, pipeline parallel's
virtual engines, each with 1/pp of the sequence slots and KV blocks, whose steps pass through
pp stages in order (a stage takes one step at a time); a lane's step time comes from the cost
model (cost.py). A request's first token is seen when its step ends, plus the cost file's
request overhead (client, frontend, sockets).
"""
from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

import numpy as np

from benchmarks.fleet.cost import CostModel, StepShape, part_features
from benchmarks.fleet.replica import Lane, Part, Seq

POLICIES = ("round_robin", "least_loaded", "prefix_affinity")


@dataclass(frozen=True)
class Workload:
    """num_requests with Poisson arrivals at `rate` per second (inf: all at once); a prompt is
    a shared prefix of prefix_len tokens (one of prefix_groups, drawn uniformly or by Zipf's
    law with exponent `zipf`; none if prefix_groups is 0) and input_len more tokens of its own."""
    num_requests: int
    rate: float = math.inf
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    prefix_groups: int = 0
    prefix_len: int = 0
    zipf: float = 0.0
    seed: int = 0

    def requests(self, block_size: int) -> list[Seq]:
        rng = np.random.default_rng(self.seed)
        n = self.num_requests
        if math.isinf(self.rate):
            arrivals = np.zeros(n)
        else:
            arrivals = np.cumsum(rng.exponential(1 / self.rate, n))
        ins = rng.integers(self.input_len[0], self.input_len[1] + 1, n)
        outs = rng.integers(self.output_len[0], self.output_len[1] + 1, n)
        groups = np.full(n, -1)
        if self.prefix_groups:
            weights = 1 / np.arange(1, self.prefix_groups + 1) ** self.zipf
            groups = rng.choice(self.prefix_groups, n, p=weights / weights.sum())
        shared = self.prefix_len if self.prefix_groups else 0
        return [Seq(rid=i, arrival=float(arrivals[i]), prompt_len=int(ins[i]) + shared,
                    out_len=int(outs[i]), group=int(groups[i]),
                    shared_blocks=shared // block_size if groups[i] >= 0 else 0)
                for i in range(n)]

    def prompt(self, seq: Seq, n: int | None = None) -> list[int]:
        """The first n token ids of the prompt of `seq` (all if None): its group's prefix, then
        its own tokens (the first two name it, so no two prompts share more than the prefix)."""
        n = seq.prompt_len if n is None else min(n, seq.prompt_len)
        shared = []
        if seq.group >= 0:
            shared = _group_prefix(self.seed, seq.group, self.prefix_len)[:n]
        own_len = n - len(shared)
        own = [10 + seq.rid % 40000, 10 + seq.rid // 40000 % 40000][:own_len]
        if own_len > 2:
            rnd = random.Random(f"{self.seed} request {seq.rid}")
            own += [rnd.randrange(10, 30000) for _ in range(own_len - 2)]
        return shared + own


@functools.lru_cache(maxsize=4096)
def _group_prefix(seed: int, group: int, length: int) -> list[int]:
    rnd = random.Random(f"{seed} group {group}")
    return [rnd.randrange(10, 30000) for _ in range(length)]


@dataclass
class Result:
    requests: int
    output_tokens: int
    makespan_s: float                        # first arrival to last finish
    tok_per_s: float                         # output tokens over the makespan
    ttft_ms: dict                            # p50, p90, p99, mean
    e2e_ms: dict
    tpot_ms: float                           # mean of (e2e - ttft) / (output - 1)
    # output tokens a second while every replica had requests waiting after the last arrival
    # (a burst's steady rate, without its drain); 0 if none had
    saturated_tok_per_s: float
    prefix_hit_rate: float                   # prompt tokens found in the prefix cache
    requests_per_replica: list[int]
    steps: int
    preemptions: int
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        return {"tok/s": round(self.tok_per_s, 1), "TTFT p50 ms": round(self.ttft_ms["p50"], 1),
                "TTFT p99 ms": round(self.ttft_ms["p99"], 1),
                "hit rate": round(self.prefix_hit_rate, 3)}


class Replica:
    def __init__(self, index: int, cost: CostModel, tp: int, pp: int, num_blocks: int,
                 max_num_seqs: int, token_budget: int, async_scheduling: bool, caching: bool):
        self.index, self.cost, self.tp, self.pp = index, cost, tp, pp
        self.lanes = [Lane(num_blocks // pp, cost.block_size, max(1, max_num_seqs // pp),
                           token_budget, async_scheduling and pp == 1, caching)
                      for _ in range(pp)]
        self.stage_free = [0.0] * pp
        self.steps = 0
        self.busy_s = 0.0
        self.saturated: tuple[float, int] | None = None   # (until, tokens by then)

    def add(self, seq: Seq) -> Lane:
        lane = min(self.lanes, key=lambda lane: lane.load)
        lane.add(seq)
        return lane

    def submit(self, parts: list[Part], now: float) -> float:
        """When a planned step's result is in: through each stage in turn."""
        tokens = seqs = kv = 0
        attn = 0.0
        for p in parts:
            tokens += p.num
            seqs += p.sample
            k, a = part_features(p.start, p.num)
            kv += k
            attn += a
        stage, total = self.cost.parallel_step(StepShape(tokens, seqs, kv, attn),
                                               self.tp, self.pp)
        t = now
        for j in range(self.pp):
            t = max(t, self.stage_free[j]) + stage
            self.stage_free[j] = t
        self.steps += 1
        self.busy_s += stage
        return t + total - stage * self.pp


def simulate(cost: CostModel, workload: Workload, dp: int = 1, tp: int = 1, pp: int = 1,
             policy: str = "prefix_affinity", frontends: int = 1, caching: bool = True,
             max_num_seqs: int | None = None, token_budget: int | None = None,
             async_scheduling: bool | None = None, num_blocks: int | None = None,
             seed: int = 0, arrivals: list[float] | None = None) -> Result:
    """Run `workload` on dp replicas of tp x pp GPUs behind `frontends` routers; `arrivals`
    (seconds, one a request in the workload's order) replace the workload's own, e.g. the
    times a measured run sent them."""
    from conveyor.frontend.router import PREFIX_BLOCKS, Router
    from conveyor.shared.messages.engine import AddRequest, TokenOutput, TokenOutputs
    from conveyor.shared.sampling_params import SamplingParams

    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    bs = cost.block_size
    blocks = num_blocks or cost.replica_blocks(tp, pp)
    replicas = [Replica(r, cost, tp, pp, blocks, max_num_seqs or cost.max_num_seqs,
                        token_budget or cost.max_num_batched_tokens,
                        cost.async_scheduling if async_scheduling is None else async_scheduling,
                        caching)
                for r in range(dp)]
    seqs = workload.requests(bs)
    if arrivals is not None:
        for seq, t in zip(seqs, arrivals, strict=True):
            seq.arrival = t
        seqs.sort(key=lambda seq: seq.arrival)
    # (time, tie, lane, its replica) for a step's end; (time, tie, None, index) for an arrival
    events: list = []
    tie = itertools.count()
    now = 0.0
    arriving: dict[str, Seq] = {}

    def deliver(r: int, msg) -> None:
        seq = arriving.pop(msg.id)
        seq.replica = r
        pump(replicas[r], replicas[r].add(seq))

    def pump(replica: Replica, lane: Lane) -> None:
        while lane.can_plan():
            parts = lane.schedule()
            if parts is None:
                break
            heapq.heappush(events, (replica.submit(parts, now), next(tie), lane, replica))

    routers = [Router([lambda msg, r=r: deliver(r, msg) for r in range(dp)], policy, bs,
                      on_outputs=lambda outputs: None, on_stats=lambda stats: None)
               for _ in range(frontends)]
    sampling = SamplingParams(max_tokens=1)
    head_len = PREFIX_BLOCKS * bs
    rng = random.Random(seed)

    for seq in seqs:
        seq.frontend = rng.randrange(frontends)
    if seqs:
        heapq.heappush(events, (seqs[0].arrival, next(tie), None, 0))
    finished: list[Seq] = []
    all_arrived = not seqs
    while events:
        now, _, lane, what = heapq.heappop(events)
        if lane is None:                     # the arrival of seqs[what]
            seq = seqs[what]
            all_arrived = what == len(seqs) - 1
            if what + 1 < len(seqs):
                heapq.heappush(events, (seqs[what + 1].arrival, next(tie), None, what + 1))
            sid = f"{seq.rid}/0"
            arriving[sid] = seq
            routers[seq.frontend].send(AddRequest(
                id=sid, token_ids=workload.prompt(seq, head_len), sampling=sampling))
            continue
        done = lane.update(now)
        if (what.saturated is None and all_arrived
                and not any(lane.waiting for lane in what.lanes)):
            what.saturated = (now, sum(lane.sampled for lane in what.lanes))
        for seq in done:
            finished.append(seq)
            routers[seq.frontend].on_message(seq.replica, TokenOutputs(
                [TokenOutput(f"{seq.rid}/0", [], finish_reason="length")]))
        pump(what, lane)
    return _result(cost, seqs, finished, replicas)


def _result(cost: CostModel, seqs: list[Seq], finished: list[Seq],
            replicas: list[Replica]) -> Result:
    if len(finished) != len(seqs):
        raise RuntimeError(f"{len(seqs) - len(finished)} requests never finished")
    over = cost.request_overhead_s
    ttft = np.array([s.first_token - s.arrival + over for s in seqs]) * 1e3
    e2e = np.array([s.finished - s.arrival + over for s in seqs]) * 1e3
    tokens = sum(s.n_out for s in seqs)
    makespan = max(s.finished for s in seqs) - min(s.arrival for s in seqs)
    tpot = [(s.finished - s.first_token) / (s.n_out - 1) for s in seqs if s.n_out > 1]
    pools = [lane.pool for r in replicas for lane in r.lanes]
    queries = sum(p.queries for p in pools)
    sat = [r.saturated for r in replicas if r.saturated is not None and r.saturated[0] > 0]
    per_replica = [0] * len(replicas)
    for s in seqs:
        per_replica[s.replica] += 1
    return Result(
        requests=len(seqs), output_tokens=tokens, makespan_s=makespan,
        tok_per_s=tokens / makespan if makespan > 0 else math.inf,
        ttft_ms=_quantiles(ttft), e2e_ms=_quantiles(e2e),
        tpot_ms=float(np.mean(tpot)) * 1e3 if tpot else 0.0,
        saturated_tok_per_s=sum(n / t for t, n in sat) * len(replicas) / len(sat) if sat else 0.0,
        prefix_hit_rate=sum(p.hits for p in pools) / queries if queries else 0.0,
        requests_per_replica=per_replica, steps=sum(r.steps for r in replicas),
        preemptions=sum(lane.num_preemptions for r in replicas for lane in r.lanes),
        extra={"busy": [r.busy_s / makespan for r in replicas] if makespan > 0 else []})


def _quantiles(ms: np.ndarray) -> dict:
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean())}
