"""The simulator against measured runs: `conveyor serve -dp N` on this machine, then the same
workload on paper with step costs measured here, side by side.

For each N in --dp (default 1 and 2): measure the step costs of one replica as it runs when N
replicas share the host (N measuring processes at once, each with the torch threads a replica's
worker takes: cpu_count // N, as conveyor/worker/process.py sets them), or read them from
--costs-dpN; start `conveyor serve -dp N --frontends 1` (the default model, ZMQ only, token-id
prompts) and run the workload through conveyor's AsyncClient: every request streamed, sent at
its arrival time, timed in the client (TTFT: send to first token; throughput: output tokens
over first send to last finish); then simulate the same requests (same lengths, arrivals and
prompt tokens) on N replicas with those costs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import time

import numpy as np

from benchmarks.fleet.cost import CostModel
from benchmarks.fleet.sim import Result, Workload, simulate


async def _client_pass(address: str, workload: Workload, seqs) -> list[tuple[float, float,
                                                                              float, int, int]]:
    """[(sent at, TTFT, end-to-end, output tokens, prompt tokens found in the prefix cache)]
    in seconds from the first send."""
    from conveyor import SamplingParams
    from conveyor.client import AsyncClient

    async with AsyncClient(address) as client:
        # a warm-up request with its own tokens, so nothing later hits its blocks
        async for _ in client.stream([7, 8, 9] * 11, SamplingParams(max_tokens=2)):
            pass
        t0 = time.perf_counter()

        async def one(seq):
            await asyncio.sleep(max(0.0, t0 + seq.arrival - time.perf_counter()))
            sent = time.perf_counter()
            first, n, cached = None, 0, 0
            params = SamplingParams(max_tokens=seq.out_len, ignore_eos=True, temperature=0.0)
            async for out in client.stream(workload.prompt(seq), params):
                n += len(out.outputs[0].token_ids)
                if out.metrics is not None:          # on the last output
                    cached = out.metrics.num_cached_tokens
                if first is None and n:
                    first = time.perf_counter()
            return sent - t0, first - sent, time.perf_counter() - sent, n, cached

        return list(await asyncio.gather(*(one(s) for s in seqs)))


def served_run(dp: int, workload: Workload, policy: str, server_flags: list[str],
               log_path: str | None = None) -> dict:
    from benchmarks.models import serve_process

    seqs = workload.requests(16)
    log = open(log_path, "w") if log_path else None
    try:
        with serve_process("--port", "-1", "--zmq-port", "0", "--skip-tokenizer-init",
                           "-dp", str(dp), "--frontends", "1", "--dp-routing-policy", policy,
                           *server_flags, stderr=log) as line:
            address = re.search(r"tcp://[\d.]+:\d+", line).group(0)
            done = asyncio.run(_client_pass(address, workload, seqs))
    finally:
        if log:
            log.close()
    sent = [d[0] for d in done]
    ttft = np.array([d[1] for d in done]) * 1e3
    tokens = sum(d[3] for d in done)
    makespan = max(d[0] + d[2] for d in done) - min(sent)
    return {"dp": dp, "requests": len(done), "output_tokens": tokens,
            "makespan_s": makespan, "tok_per_s": tokens / makespan,
            "ttft_ms": {"p50": float(np.percentile(ttft, 50)),
                        "p99": float(np.percentile(ttft, 99)), "mean": float(ttft.mean())},
            "tpot_ms": float(np.mean([(d[2] - d[1]) / (d[3] - 1) for d in done if d[3] > 1]))
            * 1e3,
            "prefix_hit_rate": sum(d[4] for d in done) / sum(s.prompt_len for s in seqs),
            "sent_s": sent}


def validate(workload: Workload, dps: list[int], policy: str, grid: dict,
             costs: dict[int, str], server_flags: list[str], output: str | None,
             say=print) -> dict:
    from benchmarks.fleet.measure import measure, save_with_samples

    cores = os.cpu_count() or 1
    doc = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cores": cores,
           "workload": dataclasses.asdict(workload) | {"rate": str(workload.rate)},
           "policy": policy, "runs": []}
    for dp in dps:
        threads = max(1, cores // dp)
        if dp in costs:
            cost = CostModel.load(costs[dp])
            say(f"dp {dp}: costs from {costs[dp]}")
        else:
            say(f"dp {dp}: measuring step costs: {dp} process(es) x {threads} thread(s) ...")
            cost, samples = measure(f"cpu-dp{dp}", {}, grid, threads=threads, copies=dp)
            if output:
                path = f"{output}.costs-dp{dp}.json"
                save_with_samples(cost, samples, path)
                say(f"  saved {path}")
        say(f"dp {dp}: serving the workload ...")
        measured = served_run(dp, workload, policy, server_flags,
                              f"{output}.server-dp{dp}.log" if output else None)
        predicted = simulate(cost, workload, dp=dp, policy=policy)
        doc["runs"].append({"dp": dp, "measured": measured, "predicted": _brief(predicted),
                            "costs": cost.source})
        say(table(doc))
        if output:
            with open(output, "w") as f:
                json.dump(doc, f, indent=1)
    return doc


def _brief(r: Result) -> dict:
    return {"tok_per_s": r.tok_per_s, "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms,
            "makespan_s": r.makespan_s, "requests_per_replica": r.requests_per_replica}


def table(doc: dict) -> str:
    rows = ["| replicas | tok/s measured | predicted | error | TTFT p50 ms measured | predicted "
            "| error | TTFT p99 ms measured | predicted | error |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in doc["runs"]:
        m, p = run["measured"], run["predicted"]
        cells = [str(run["dp"])]
        for get in (lambda d: d["tok_per_s"], lambda d: d["ttft_ms"]["p50"],
                    lambda d: d["ttft_ms"]["p99"]):
            a, b = get(m), get(p)
            cells += [f"{a:,.1f}", f"{b:,.1f}", f"{(b - a) / a:+.1%}"]
        rows.append("| " + " | ".join(cells) + " |")
    runs = {r["dp"]: r for r in doc["runs"]}
    if 1 in runs and 2 in runs:
        m = runs[2]["measured"]["tok_per_s"] / runs[1]["measured"]["tok_per_s"]
        p = runs[2]["predicted"]["tok_per_s"] / runs[1]["predicted"]["tok_per_s"]
        rows.append(f"\nDP 2 / DP 1 throughput: measured {m:.2f}x, predicted {p:.2f}x")
    return "\n".join(rows)
