"""Scheduling policies under a mixed workload: objective attainment and throughput against load.

Measures the engine's capacity first (requests/s with every request sent at once, fcfs, on a
server warmed by one untimed pass of the same workload), then for each policy starts `conveyor
serve --scheduling-policy P`, warms it the same way and runs benchmarks/serving.py's mixed
workload at each load (a multiple of that capacity, Poisson arrivals); every policy sees
the same requests at a load. Interactive requests are streamed (their TTFT is what is judged),
batch requests are not unless --batch-stream. Writes every report as JSON and a plot: the
interactive requests' time-to-first-token attainment and the output throughput, per policy,
against load.

    python scripts/bench_policies.py --output policies.json --plot policies.png       # CPU
    python scripts/bench_policies.py --shape qwen3-0.6b --random-weights \\
        --output gpu.json --plot gpu.png -- --device cuda --skip-tokenizer-init

Arguments after `--` go to `conveyor serve`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import signal
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks import serving as bench_serving
from benchmarks.models import serve_process
from benchmarks.stresskit.harness import parse_metrics


@contextlib.contextmanager
def served(policy: str, model: str | None, server_args: list[str], timeout: float = 900):
    """`conveyor serve` with `policy` on a free port; yields its HTTP base URL."""
    with serve_process("--port", "0", "--zmq-port", "0", "--scheduling-policy", policy,
                       *(["--model", model] if model else []), *server_args,
                       timeout=timeout) as line:
        yield re.search(r"http://[\d.]+:\d+", line).group(0)


def counters(base_url: str) -> dict[str, float]:
    """The server's preemptions and its TTFT objectives judged and missed so far (GET /metrics).

    The server judges a first token when the scheduler takes it, so its attainment leaves out
    the HTTP path and the client; bench_serving's attainment includes them.
    """
    metrics = parse_metrics(httpx.get(f"{base_url}/metrics", timeout=30).text)
    return {"preemptions": metrics["conveyor:num_preemptions_total"],
            "judged": metrics["conveyor:slo_judged_total{objective=ttft}"],
            "missed": metrics["conveyor:slo_missed_total{objective=ttft}"]}


def workload_args(args, base_url: str, rate: float, seed: int, warmup: int,
                  policy: str) -> list[str]:
    # NOTE: a priority is sent only to the policy that reads it; the others refuse it (400)
    priority = (["--interactive-priority", str(args.interactive_priority)]
                if policy == "priority" else [])
    return [*priority, "--base-url", base_url, "--num-prompts", str(args.num_prompts),
            "--request-rate", str(rate), "--seed", str(seed), "--warmup", str(warmup),
            "--random-input-len", str(args.random_input_len),
            "--random-output-len", str(args.random_output_len),
            "--random-range-ratio", str(args.random_range_ratio),
            "--interactive-share", str(args.interactive_share),
            "--interactive-ttft-slo", str(args.interactive_ttft_slo),
            "--interactive-input-len", str(args.interactive_input_len),
            "--interactive-output-len", str(args.interactive_output_len),
            "--batch-stream" if args.batch_stream else "--no-batch-stream"]


def plot(runs: list[dict], capacity: float, slo: float, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for k, policy in enumerate(dict.fromkeys(r["policy"] for r in runs)):
        mine = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["load"])
        xs = [r["load"] for r in mine]
        attained = [100 * (r["report"]["classes"]["interactive"]["slo_attainment"] or 0)
                    for r in mine]
        style = f"C{k}{'os^vD'[k % 5]}{['-', '--', ':'][k % 3]}"   # lines that coincide show
        left.plot(xs, attained, style, label=policy, markersize=9 - 2 * k, alpha=0.8)
        right.plot(xs, [r["report"]["output_throughput"] for r in mine], style, label=policy,
                   markersize=9 - 2 * k, alpha=0.8)
    left.set_ylabel(f"interactive requests with TTFT <= {slo:g} s (%)")
    left.set_ylim(0, 105)
    right.set_ylabel("output throughput, all requests (tok/s)")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        ax.set_xlabel(f"offered load (x capacity = {capacity:.2f} req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 140), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    # NOTE: a SIGTERM (timeout, a batch system) unwinds, so the server of the run is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    ours, server_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Hugging Face folder or .gguf (default: the default model)")
    ap.add_argument("--shape", help="build this shape with random weights (scripts/bench_models)")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--policies", default="fcfs,priority,deadline")
    ap.add_argument("--loads", default="0.5,1,1.5,2", help="multiples of the measured capacity")
    ap.add_argument("--num-prompts", type=int, default=60, help="requests per run")
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=32)
    ap.add_argument("--random-range-ratio", type=float, default=0.5)
    ap.add_argument("--interactive-share", type=float, default=0.2)
    ap.add_argument("--interactive-ttft-slo", type=float, default=1.0)
    ap.add_argument("--interactive-priority", type=int, default=-1)
    ap.add_argument("--interactive-input-len", type=int, default=32)
    ap.add_argument("--interactive-output-len", type=int, default=16)
    ap.add_argument("--batch-stream", action=argparse.BooleanOptionalAction, default=False,
                    help="stream the batch requests too (by default they are not: streaming "
                         "every token of every request makes one client process the bottleneck "
                         "on a GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", help="write the results here (JSON)")
    ap.add_argument("--plot", help="write the attainment and throughput plot here (PNG)")
    args = ap.parse_args(ours)
    model = args.model
    if args.shape:
        if not args.random_weights:
            ap.error("--shape needs --random-weights")
        from benchmarks.models import build_random_model
        model = str(build_random_model(args.shape))
    policies, loads = args.policies.split(","), [float(x) for x in args.loads.split(",")]

    def run(url: str, policy: str, rate: float, seed: int, warmup: int) -> dict:
        before = counters(url)
        [report] = bench_serving.main(workload_args(args, url, rate, seed, warmup, policy))
        after = counters(url)                                  # warm-up requests included
        report["preemptions"] = after["preemptions"] - before["preemptions"]
        judged = after["judged"] - before["judged"]
        report["server_slo_attainment"] = (
            1 - (after["missed"] - before["missed"]) / judged if judged else None)
        return report

    # NOTE: every server first serves the whole workload once at full speed, untimed, so that
    # kernel compilation and first-use costs fall outside every measurement; the seeds differ,
    # so no measured run finds its prompts in the prefix cache.
    def warm(url: str, policy: str) -> None:
        run(url, policy, math.inf, args.seed + 2000, warmup=1)

    with served("fcfs", model, server_args) as url:
        warm(url, "fcfs")
        saturated = run(url, "fcfs", math.inf, args.seed + 1000, warmup=0)
    capacity = saturated["request_throughput"]
    print(f"capacity: {capacity:.3f} requests/s", flush=True)
    runs = []
    for policy in policies:
        with served(policy, model, server_args) as url:
            warm(url, policy)
            for k, load in enumerate(loads):
                report = run(url, policy, load * capacity, args.seed + k, warmup=0)
                runs.append({"policy": policy, "load": load, "report": report})
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "git_revision": bench_serving.git_revision(), "command": sys.argv,
              "model": saturated["model"], "server_args": server_args,
              "capacity_req_s": capacity, "capacity_run": saturated, "runs": runs}
    print(f"{'policy':>10} {'load':>5} {'attained':>9} {'(server)':>9} {'TTFT p50':>9} "
          f"{'batch p50':>10} {'out tok/s':>10} {'preempted':>10} {'failed':>7}")
    for r in runs:
        rep = r["report"]
        inter, batch = rep["classes"]["interactive"], rep["classes"]["batch"]
        cells = ["-" if c["ttft_ms"]["p50"] is None else f"{c['ttft_ms']['p50']:.0f} ms"
                 for c in (inter, batch)]
        server = rep["server_slo_attainment"]
        server = "-" if server is None else f"{server:.0%}"
        print(f"{r['policy']:>10} {r['load']:>5g} {inter['slo_attainment'] or 0:>9.0%} "
              f"{server:>9} {cells[0]:>9} {cells[1]:>10} {rep['output_throughput']:>10.1f} "
              f"{rep['preemptions']:>10.0f} {rep['failed']:>7}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(runs, capacity, args.interactive_ttft_slo,
             f"{saturated['model']}: {args.interactive_share:.0%} interactive "
             f"({args.interactive_input_len} in / {args.interactive_output_len} out, TTFT "
             f"objective {args.interactive_ttft_slo:g} s), batch {args.random_input_len} in / "
             f"{args.random_output_len} out; {' '.join(server_args)}", args.plot)
    return result


if __name__ == "__main__":
    main()
