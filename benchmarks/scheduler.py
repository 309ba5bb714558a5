"""Host time of the scheduler a step: the reference workload's prompts (reference_workload.py)
decoding together, with no model: each plan goes through the wire format and is answered at
once with random tokens. Reports microseconds per decode step of `schedule()`,
`update()` and the plan's and result's msgpack round trip, at the full batch.

The step loop's host work is what the GPU waits for when the host falls behind (docs/BENCHMARKS.md,
"GPU: reference offline workload": about 1 ms of slack a step); this measures the scheduler's
share without a GPU.

    python scripts/bench_scheduler.py [--requests 256] [--steps 300] [--async-scheduling 0|1]
"""
from __future__ import annotations

import argparse
import random
import time

from benchmarks.reference_workload import workload
from conveyor.scheduler.scheduler import Scheduler
from conveyor.shared.config import EngineConfig
from conveyor.shared.messages import decode, encode
from conveyor.shared.messages.engine import AddRequest
from conveyor.shared.messages.worker import StepPlan, StepResult
from conveyor.shared.sampling_params import SamplingParams


def run(requests: int, steps: int, async_scheduling: bool, seed: int = 0) -> dict[str, float]:
    """Microseconds a step (schedule, update, codec) over the decode steps with every request
    running."""
    config = EngineConfig(max_num_seqs=requests, max_num_batched_tokens=16384,
                          async_scheduling=async_scheduling)
    sched = Scheduler(config, num_blocks=72686, eos_token_ids=(2,), max_model_len=40960)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.6, max_tokens=steps, ignore_eos=True)
    prompts, _ = workload(requests)
    for i, prompt in enumerate(prompts):
        sched.add(AddRequest(id=str(i), token_ids=prompt, sampling=params, arrival=time.time()))
    totals = dict(schedule=0.0, update=0.0, codec=0.0)
    counted = 0
    in_flight: list[StepPlan] = []
    while sched.has_work():
        t0 = time.perf_counter()
        plan = sched.schedule() if sched.can_schedule() else None
        t1 = time.perf_counter()
        full = (plan is not None and len(plan.seqs) == requests
                and all(s.num_tokens == 1 for s in plan.seqs))
        if plan is not None:
            in_flight.append(decode(encode(plan), (StepPlan,)))
        t2 = time.perf_counter()
        if plan is not None and len(in_flight) < sched.max_in_flight:
            continue
        done = in_flight.pop(0)
        num = sum(s.sample for s in done.seqs)
        result = StepResult(done.step, [rng.randint(3, 10000) for _ in range(num)], [None] * num,
                            [])
        t3 = time.perf_counter()
        result = decode(encode(result), (StepResult,))
        t4 = time.perf_counter()
        sched.update(result)
        t5 = time.perf_counter()
        if full:
            totals["schedule"] += t1 - t0
            totals["codec"] += (t2 - t1) + (t4 - t3)
            totals["update"] += t5 - t4
            counted += 1
    return {k: 1e6 * v / max(counted, 1) for k, v in totals.items()} | {"steps": counted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300, help="output tokens a request")
    ap.add_argument("--async-scheduling", type=int, choices=(0, 1), default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for _ in range(args.repeats):
        r = run(args.requests, args.steps, bool(args.async_scheduling))
        print(f"{args.requests} requests, {r['steps']} full decode steps: schedule "
              f"{r['schedule']:.0f} us, update {r['update']:.0f} us, plan + result codec "
              f"{r['codec']:.0f} us a step", flush=True)


if __name__ == "__main__":
    main()
