"""Reliability under load, faults and bad input, against a real `conveyor serve` on loopback.

Each scenario starts its own server (default model, CPU), drives it from client threads over
HTTP (OpenAI API, SSE) and ZMQ (`conveyor.client` and raw frames), then checks what must hold:
nothing lost (every request sent ends exactly once), no leaked KV block (`num_total_blocks -
num_free_blocks` once idle, `integrity_ok`), no state left in any frontend
(`frontend_open_requests`), no crash, no hang. Resident memory per
process is sampled from `GET /metrics` through the run.

    python scripts/stress.py --scenario all --duration 100 --json stress.jsonl
    python scripts/stress.py --scenario abort-storm --duration 60 --concurrency 32

Scenarios: abort-storm, kv-pressure, faults, graceful-stop, bad-input, load (see each function
in benchmarks/stresskit/scenarios.py and fuzz.py). Every scenario returns a `Report` whose
`problems` list what failed; the script prints a table and exits 1 if any scenario has a problem.
tests/reliability/ imports the same functions (benchmarks.stresskit) and runs them in small form,
so the short and the long versions are the same code.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import datetime, timezone

from benchmarks.stresskit.fuzz import bad_input
from benchmarks.stresskit.harness import Report, launch
from benchmarks.stresskit.scenarios import abort_storm, fault, graceful_stop, kv_pressure, load

SCENARIOS = ("abort-storm", "kv-pressure", "faults", "graceful-stop", "bad-input", "load")


def run(name: str, a: argparse.Namespace) -> list[Report]:
    """One scenario of the command line, on servers of its own; the server's flags are added
    to each report's `load`."""
    flags = ["--max-num-seqs", str(a.max_num_seqs)]
    d = a.duration
    if name == "kv-pressure":
        flags += ["--num-kv-blocks", str(a.num_kv_blocks or a.max_num_seqs + 2)]
    elif name == "faults":
        flags += ["--frontends", "2"]
    elif name == "graceful-stop":
        flags += ["--shutdown-timeout", f"{a.shutdown_timeout:g}"]
    elif name == "load":
        flags += ["--max-queued-requests", str(a.max_queued_requests or a.max_num_seqs)]
    reports = []
    for victim in ("worker-0", "scheduler", "frontend-1") if name == "faults" else (None,):
        with launch(*flags) as s:
            if name == "abort-storm":
                r = abort_storm(s, duration=d, concurrency=a.concurrency,
                                max_tokens=a.max_tokens, seed=a.seed)
            elif name == "kv-pressure":
                r = kv_pressure(s, duration=d, concurrency=a.concurrency,
                                max_tokens=max(a.max_tokens, 48))
            elif name == "faults":
                r = fault(s, victim, duration=d / 3, max_tokens=128,
                          concurrency=min(a.concurrency, a.max_num_seqs))
            elif name == "graceful-stop":
                r = graceful_stop(s, duration=d, concurrency=a.concurrency,
                                  shutdown_timeout=a.shutdown_timeout)
            elif name == "bad-input":
                r = bad_input(s, duration=d, seed=a.seed)
            elif name == "load":
                r = load(s, duration=d, concurrency=4 * a.max_num_seqs, max_tokens=a.max_tokens)
            else:
                raise ValueError(f"unknown scenario {name!r}")
        r.load += "; " + " ".join(f.removeprefix("--") for f in flags)
        reports.append(r)
    return reports


COLUMNS = ("scenario", "load", "duration s", "sent", "finished", "aborted", "failed", "lost",
           "leaked blocks", "peak memory MiB")


def table(reports: list[Report]) -> str:
    """A Markdown table of the reports."""
    rows = [COLUMNS, ["---"] * len(COLUMNS)]
    for r in reports:
        peak = ", ".join(f"{k} {v['peak']:.0f}" for k, v in r.memory_mib.items()
                         if not k.startswith("python"))
        rows.append([r.scenario, r.load, f"{r.duration_s:g}", r.sent, r.finished, r.aborted,
                     r.failed, r.lost, "-" if r.leaked_blocks is None else r.leaked_blocks,
                     peak])
    return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="all", choices=("all",) + SCENARIOS)
    p.add_argument("--duration", type=float, default=60.0, help="seconds per scenario")
    p.add_argument("--concurrency", type=int, default=32, help="client threads")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the server's sequence cap")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="kv-pressure's pool (default max-num-seqs + 2)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="load's queue cap (default max-num-seqs)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--shutdown-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT",
                   help="append one JSON object per scenario to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    reports: list[Report] = []
    for name in SCENARIOS if a.scenario == "all" else (a.scenario,):
        print(f"stress: {name} ...", file=sys.stderr, flush=True)
        for r in run(name, a):
            reports.append(r)
            print(json.dumps(dataclasses.asdict(r)), file=sys.stderr, flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    row = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           **dataclasses.asdict(r)}
                    f.write(json.dumps(row) + "\n")
    print(table(reports))
    for r in reports:
        for problem in r.problems:
            print(f"PROBLEM {r.scenario}: {problem}")
    return 1 if any(r.problems for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
