"""scripts/simulate_fleet.py: predict a fleet's throughput and TTFT from measured step costs.

    python scripts/simulate_fleet.py run --costs h200-llama3.1-8b --dp 8 --rate 40
    python scripts/simulate_fleet.py table --costs h200-llama3.1-8b --gpus 8,64,512
    python scripts/simulate_fleet.py routers --costs h200-qwen3-0.6b --dp 8
    python scripts/simulate_fleet.py routers --dp 2 --measure --requests 512 --rate inf \
        --prefix-groups 16 --prefix-len 2048 --zipf 0 --input-len 64 --output-len 128 \
        -- --model FOLDER --device cuda            # also served here, side by side
    python scripts/simulate_fleet.py measure --output cpu.json [--threads 1 --copies 2]
    python scripts/simulate_fleet.py validate --output cpu-dp.json     # serve -dp 1 and 2

The model and its assumptions: docs/SCALING.md. Cost files: benchmarks/fleet/costs/ (by name)
or any path that `measure` wrote.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from benchmarks.fleet.cost import CostModel, describe
from benchmarks.fleet.sim import POLICIES, Result, Workload, simulate


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"want LO:HI with 1 <= LO <= HI, got {text!r}")
    return a, b


def _workload_args(ap: argparse.ArgumentParser, requests: int, input_len: str, output_len: str,
                   rate: str) -> None:
    g = ap.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=requests)
    g.add_argument("--rate", type=float, default=float(rate),
                   help="Poisson arrivals a second (inf: all at once)")
    g.add_argument("--input-len", type=_range, default=_range(input_len),
                   help="LO:HI tokens of a prompt's own (uniform)")
    g.add_argument("--output-len", type=_range, default=_range(output_len), help="LO:HI")
    g.add_argument("--prefix-groups", type=int, default=0,
                   help="shared prompt prefixes (0: none)")
    g.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    g.add_argument("--zipf", type=float, default=0.0,
                   help="prefix popularity: Zipf exponent (0: uniform)")
    g.add_argument("--seed", type=int, default=0)


def _workload(args) -> Workload:
    return Workload(args.requests, args.rate, args.input_len, args.output_len,
                    args.prefix_groups, args.prefix_len, args.zipf, args.seed)


def _engine_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("engine (default: the cost file's)")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--frontends", type=int, default=1)


def _sim(cost, workload, args, **kw) -> Result:
    return simulate(cost, workload, max_num_seqs=args.max_num_seqs,
                    token_budget=args.max_num_batched_tokens,
                    caching=not args.no_prefix_caching, frontends=args.frontends, **kw)


def cmd_run(args) -> None:
    cost = CostModel.load(args.costs)
    r = _sim(cost, _workload(args), args, dp=args.dp, tp=args.tp, pp=args.pp,
             policy=args.policy)
    print(describe(cost))
    print(json.dumps(dataclasses.asdict(r), indent=1) if args.json
          else _summary(r, math.isinf(args.rate)))


def _summary(r: Result, burst: bool) -> str:
    steady = f" (saturated {r.saturated_tok_per_s:,.0f})" if burst else ""
    return (f"{r.requests} requests, {r.output_tokens} output tokens in {r.makespan_s:.2f} s: "
            f"{r.tok_per_s:,.0f} tok/s{steady}; TTFT p50 "
            f"{r.ttft_ms['p50']:.1f} ms, p99 {r.ttft_ms['p99']:.1f} ms; TPOT {r.tpot_ms:.2f} ms; "
            f"prefix-cache hit rate {r.prefix_hit_rate:.1%}; requests per replica "
            f"{min(r.requests_per_replica)}-{max(r.requests_per_replica)}; "
            f"{r.preemptions} preemptions")


def layouts(gpus: int, per_node: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) layouts of `gpus`: TP inside a node, PP across nodes."""
    out = []
    for tp, pp in ((1, 1), (2, 1), (per_node, 1), (per_node, 2)):
        if gpus % (tp * pp) == 0 and tp * pp <= gpus:
            out.append((gpus // (tp * pp), tp, pp))
    return out


def fleet_row(cost: CostModel, dp: int, tp: int, pp: int, load_per_gpu: float, args,
              max_replicas: int) -> dict:
    """One layout: its saturated throughput (a burst) and its latency under Poisson load of
    load_per_gpu requests a second a GPU. A fleet of more than max_replicas replicas is
    simulated as max_replicas of them carrying their share of the load (and of the prefix
    groups): the routers' choices are local, so the others only repeat them."""
    k = min(dp, max_replicas)
    per = max(1, cost.max_num_seqs) * 2
    burst = Workload(per * k, math.inf, args.input_len, args.output_len, seed=args.seed)
    sat = _sim(cost, burst, args, dp=k, tp=tp, pp=pp, policy=args.policy)
    rate = load_per_gpu * tp * pp * k
    n = max(args.requests * k, int(rate * args.duration))
    groups = max(1, args.prefix_groups * k // dp) if args.prefix_groups else 0
    poisson = Workload(n, rate, args.input_len, args.output_len, groups, args.prefix_len,
                       args.zipf, args.seed)
    lat = _sim(cost, poisson, args, dp=k, tp=tp, pp=pp, policy=args.policy)
    scale = dp / k
    return {"gpus": dp * tp * pp, "dp": dp, "tp": tp, "pp": pp,
            "simulated replicas": k,
            "saturated tok/s": sat.saturated_tok_per_s * scale,
            "tok/s per GPU": sat.saturated_tok_per_s / (k * tp * pp),
            "rate req/s": rate * scale,
            "TTFT p50 ms": lat.ttft_ms["p50"], "TTFT p99 ms": lat.ttft_ms["p99"],
            "TPOT ms": lat.tpot_ms}


def cmd_table(args) -> None:
    cost = CostModel.load(args.costs)
    print(describe(cost))
    if args.load_per_gpu is None:            # half of what one GPU serves as a TP1 replica
        one = fleet_row(cost, 1, 1, 1, 0.1, args, 1)
        mean_out = sum(args.output_len) / 2
        args.load_per_gpu = 0.5 * one["saturated tok/s"] / mean_out
    print(f"offered load: {args.load_per_gpu:.2f} requests a second a GPU")
    rows = []
    for gpus in args.gpus:
        for dp, tp, pp in layouts(gpus, args.gpus_per_node):
            t = time.perf_counter()
            rows.append(fleet_row(cost, dp, tp, pp, args.load_per_gpu, args, args.max_replicas))
            print(f"  {gpus} GPUs, DP {dp} x TP {tp} x PP {pp}: {time.perf_counter() - t:.1f} s",
                  file=sys.stderr)
    print(_markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"costs": cost.name, "load_per_gpu": args.load_per_gpu, "rows": rows},
                      f, indent=1)


def cmd_routers(args) -> None:
    from conveyor.frontend import router

    cost = CostModel.load(args.costs)
    print(describe(cost))
    workload = _workload(args)
    own = router.MAX_IMBALANCE
    runs = [("round_robin", own), ("least_loaded", own)] + [
        ("prefix_affinity", m) for m in args.max_imbalance or [own]]
    rows = []
    try:
        for policy, imbalance in runs:
            # NOTE: a what-if: the Router reads its threshold from the module at each choice
            router.MAX_IMBALANCE = imbalance
            r = _sim(cost, workload, args, dp=args.dp, tp=args.tp, policy=policy)
            name = policy if policy != "prefix_affinity" else f"{policy} ({imbalance})"
            rows.append({"policy (imbalance threshold)": name,
                         "prefix-cache hit rate": f"{r.prefix_hit_rate:.1%}",
                         "tok/s": r.tok_per_s, "TTFT p50 ms": r.ttft_ms["p50"],
                         "TTFT p99 ms": r.ttft_ms["p99"],
                         "requests per replica (min-max)":
                             f"{min(r.requests_per_replica)}-{max(r.requests_per_replica)}"})
            if args.measure and imbalance == own:
                rows[-1] |= _measured(args, workload, policy, cost)
    finally:
        router.MAX_IMBALANCE = own
    print(_markdown(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                       "argv": sys.argv, "rows": rows}, f, indent=1)


def _measured(args, workload: Workload, policy: str, cost: CostModel) -> dict:
    """The same workload through `conveyor serve -dp N` here with `policy` (the server's own
    imbalance threshold), measured in the client: its columns for the routers table, and the
    simulation again with the requests arriving when the client sent them (an `--rate inf`
    burst leaves the client over a few milliseconds, not at once)."""
    from benchmarks.fleet.validate import served_run

    log = f"{args.output}.server-{policy}.log" if args.output else None
    m = served_run(args.dp, workload, policy, args.server_flags, log)
    again = _sim(cost, workload, args, dp=args.dp, tp=args.tp, policy=policy,
                 arrivals=m["sent_s"])
    return {"measured hit rate": f"{m['prefix_hit_rate']:.1%}",
            "measured tok/s": m["tok_per_s"], "measured TTFT p50 ms": m["ttft_ms"]["p50"],
            "measured TTFT p99 ms": m["ttft_ms"]["p99"],
            "at the sends: predicted hit rate": f"{again.prefix_hit_rate:.1%}",
            "predicted tok/s": again.tok_per_s, "predicted TTFT p50 ms": again.ttft_ms["p50"]}


def cmd_measure(args) -> None:
    from benchmarks.fleet.measure import CPU_GRID, CUDA_GRID, measure, save_with_samples

    engine = dict(kv.split("=", 1) for kv in args.engine_arg)
    for key, value in engine.items():
        try:
            engine[key] = json.loads(value)
        except json.JSONDecodeError:
            pass
    grid = CUDA_GRID if engine.get("device") == "cuda" else CPU_GRID
    cost, samples = measure(os.path.splitext(os.path.basename(args.output))[0], engine, grid,
                            threads=args.threads, copies=args.copies)
    save_with_samples(cost, samples, args.output)
    print(describe(cost))
    worst = max(abs(cost.step_time(s) / t - 1) for s, t in samples)
    print(f"{len(samples)} step shapes; worst fit error {worst:.0%}; saved {args.output}")


def cmd_validate(args) -> None:
    from benchmarks.fleet.measure import CPU_GRID
    from benchmarks.fleet.validate import validate

    costs = {1: args.costs_dp1, 2: args.costs_dp2}
    validate(_workload(args), args.dp, args.policy, CPU_GRID,
             {k: v for k, v in costs.items() if v}, args.server_flags, args.output)


def _markdown(rows: list[dict]) -> str:
    def cell(v):
        return f"{v:,.1f}" if isinstance(v, float) else str(v)

    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    lines += ["| " + " | ".join(cell(r[k]) for k in head) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="one simulation")
    p.add_argument("--costs", default="h200-llama3.1-8b")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--policy", choices=POLICIES, default="prefix_affinity")
    p.add_argument("--json", action="store_true", help="the whole result as JSON")
    _workload_args(p, 1000, "100:1024", "100:1024", "inf")
    _engine_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("table", help="fleet layouts: saturated throughput, TTFT under load")
    p.add_argument("--costs", default="h200-llama3.1-8b")
    p.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8, 64, 512])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--policy", choices=POLICIES, default="prefix_affinity")
    p.add_argument("--load-per-gpu", type=float, default=None,
                   help="requests a second a GPU (default: half a TP1 replica's capacity)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of Poisson arrivals at least")
    p.add_argument("--max-replicas", type=int, default=8)
    p.add_argument("--json", help="also write the rows here")
    _workload_args(p, 64, "100:1024", "100:1024", "inf")
    _engine_args(p)
    p.set_defaults(func=cmd_table)

    p = sub.add_parser("routers", help="router policies under shared-prefix load")
    p.add_argument("--costs", default="h200-qwen3-0.6b")
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-imbalance", type=lambda s: [int(x) for x in s.split(",")],
                   help="prefix_affinity's thresholds to compare (default: the router's own)")
    p.add_argument("--measure", action="store_true",
                   help="also serve the workload here (`conveyor serve -dp DP`, each policy) "
                        "and measure it in the client: hit rate, tok/s, TTFT")
    p.add_argument("--output", help="the rows as JSON (with --measure, the server logs beside it)")
    p.add_argument("server_flags", nargs="*",
                   help="after --: more `conveyor serve` flags (--model, --device cuda, ...)")
    _workload_args(p, 8000, "50:300", "50:300", "400")
    p.set_defaults(prefix_groups=4096, prefix_len=1024, zipf=1.0)
    _engine_args(p)
    p.set_defaults(func=cmd_routers)

    p = sub.add_parser("measure", help="step costs of the real engine on this machine")
    p.add_argument("--output", required=True, help="the cost file to write")
    p.add_argument("--threads", type=int, help="torch threads of each measuring process")
    p.add_argument("--copies", type=int, default=1, help="measuring processes at once")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an LLM argument (e.g. device=cuda, model=PATH); repeatable")
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("validate", help="serve -dp 1 and 2 here against the prediction")
    p.add_argument("--dp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--policy", choices=POLICIES, default="prefix_affinity")
    p.add_argument("--costs-dp1", help="a cost file instead of measuring (one replica)")
    p.add_argument("--costs-dp2", help="... (two replicas sharing the host)")
    p.add_argument("--output", help="results JSON (cost files and server logs beside it)")
    p.add_argument("server_flags", nargs="*", help="after --: more `conveyor serve` flags")
    _workload_args(p, 60, "32:256", "16:64", "1.0")
    p.set_defaults(func=cmd_validate)

    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
