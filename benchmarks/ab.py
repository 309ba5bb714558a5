"""A/B of a benchmark: run one command as fresh processes, alternating between variants ("arms"),
and report each arm's mean and spread and each arm's difference from the first with its
standard error.

Why: between processes running the same code, bench_latency's ms/token varies with a standard
deviation of about 1.1 % (H200, docs/BENCHMARKS.md, "Single-stream decode latency"). Two runs
an arm cannot show a 2 % change; about eight interleaved runs an arm can. Interleaving (and
rotating which arm goes first in each round) keeps a drift of the machine from landing on one arm.

An arm is NAME=ENV (environment assignments, space-separated; empty for none) or NAME@REV (the
command runs in an export of git revision REV's tracked files, with REV's `conveyor` first on
PYTHONPATH). REV may also be a folder holding such an export, for a copy of the checkout without
its git history (the device machine's: `git archive REV | tar -x -C .whl/old` here, then
`--arm old@.whl/old` there):

    python scripts/ab.py --runs 8 --arm head= --arm no-pdl=CONVEYOR_PDL=0 -- \\
        python3 scripts/bench_latency.py --shape llama3.1-8b --random-weights --load-format dummy
    python scripts/ab.py --arm old@HEAD~1 --arm new= -- python3 scripts/bench_latency.py ...

The figure taken from a run is the last match of --pattern (default: "<number> ms/token") in
its output; a run without one counts as failed and its output's tail is printed.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Arm:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    rev: str | None = None
    tree: Path | None = None            # the export of rev
    values: list[float] = field(default_factory=list)
    failed: int = 0


def parse_arm(spec: str) -> Arm:
    if "@" in spec and ("=" not in spec or spec.index("@") < spec.index("=")):
        name, rev = spec.split("@", 1)
        return Arm(name, rev=rev)
    if "=" not in spec:
        raise SystemExit(f"--arm {spec!r}: give NAME=ENV or NAME@REV")
    name, assignments = spec.split("=", 1)
    env = {}
    for a in shlex.split(assignments):
        key, sep, value = a.partition("=")
        if not sep:
            raise SystemExit(f"--arm {spec!r}: {a!r} is not KEY=VALUE")
        env[key] = value
    return Arm(name, env)


def export(rev: str, into: Path) -> Path:
    """REV's tracked files, written under `into` (git archive: no untracked or ignored files)."""
    tree = into / re.sub(r"[^\w.-]", "_", rev)
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def run_once(arm: Arm, command: list[str], pattern: re.Pattern) -> float | None:
    env = dict(os.environ, **arm.env)
    cwd = ROOT
    if arm.tree is not None:
        cwd = arm.tree
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(arm.tree),
                                                          env.get("PYTHONPATH")]))
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    found = [m.group(1) for m in pattern.finditer(proc.stdout + proc.stderr)]
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        print(f"  {arm.name}: failed (exit {proc.returncode}): " + " | ".join(tail), flush=True)
        return None
    return float(found[-1])


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for a single value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summary(arms: list[Arm]) -> str:
    rows = ["| arm | runs | mean | sd | min | max | vs first | its SE |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    first = arms[0]
    mean0, sd0 = spread(first.values) if first.values else (0.0, 0.0)   # no runs: unused
    for arm in arms:
        v = arm.values
        if not v:
            rows.append(f"| {arm.name} | 0 ({arm.failed} failed) | | | | | | |")
            continue
        mean, sd = spread(v)
        diff = se = ""
        if arm is not first and len(v) > 1 and len(first.values) > 1:
            d = mean - mean0
            diff = f"{d:+.4g} ({d / mean0 * 100:+.1f} %)"
            se = f"{(sd ** 2 / len(v) + sd0 ** 2 / len(first.values)) ** 0.5:.2g}"
        runs = f"{len(v)}" + (f" ({arm.failed} failed)" if arm.failed else "")
        rows.append(f"| {arm.name} | {runs} | {mean:.4g} | {sd:.2g} | {min(v):.4g} "
                    f"| {max(v):.4g} | {diff} | {se} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: ab.py [--runs N] [--pattern RE] --arm A --arm B ... -- COMMAND")
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME=ENV or NAME@REV")
    ap.add_argument("--runs", type=int, default=8, help="runs an arm")
    ap.add_argument("--pattern", default=r"([0-9.]+) ms/token",
                    help="regex whose first group is the figure")
    args = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command or len(args.arm) < 2 or args.runs < 1:
        raise SystemExit("give a command, two or more arms and --runs >= 1")
    if os.sep in command[0]:        # a relative program stays this folder's in every arm's tree
        command[0] = os.path.abspath(command[0])
    arms = [parse_arm(a) for a in args.arm]
    pattern = re.compile(args.pattern)
    if pattern.groups < 1:
        raise SystemExit(f"--pattern {args.pattern!r}: put the figure in a group, (...)")
    with tempfile.TemporaryDirectory(prefix="conveyor-ab-") as tmp:
        for arm in arms:
            if arm.rev is not None:
                folder = Path(arm.rev)
                arm.tree = folder.resolve() if folder.is_dir() else export(arm.rev, Path(tmp))
        for r in range(args.runs):
            for i in range(len(arms)):
                arm = arms[(r + i) % len(arms)]          # each round starts one arm later
                value = run_once(arm, command, pattern)
                if value is None:
                    arm.failed += 1
                else:
                    arm.values.append(value)
                    print(f"  round {r + 1}: {arm.name} {value:g}", flush=True)
    print(summary(arms))


if __name__ == "__main__":
    main()
