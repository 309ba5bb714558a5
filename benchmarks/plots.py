"""Plots of saved request-path results (benchmarks/request_path.py's JSON documents), drawn with
matplotlib (Agg) into a folder (default docs/):

- PREFIX_rates.png: output tok/s against the Poisson request rate (each run's offline tok/s as
  a dashed line of its colour: the ceiling), and TTFT p50 / p99 against the rate;
- PREFIX_cdf.png: the CDFs of TTFT and of ITL (every gap between content chunks), one line per
  rate of each run.

    python scripts/plot_benchmarks.py results/h200-qwen3.json [more.json ...] [--out-dir docs]
    python scripts/plot_benchmarks.py run.json --compact docs/results/h200-qwen3.json

A compact document (compact()) keeps every figure and per-request latency but ITL gaps, of
which it keeps each rate's distribution: the form docs/results/ holds.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def label(doc: dict, path: str) -> str:
    """A run's name in a legend: device, model, revision (else the file's name)."""
    parts = [doc.get("device"), Path(str(doc.get("model") or "")).name or None,
             doc.get("git_revision")]
    return ", ".join(p for p in parts if p) or Path(path).stem


def rate_positions(docs: list[dict]) -> dict[str, float]:
    """x of each rate name: its value; 'inf' (all at once) at twice the largest finite rate."""
    names = {r["rate"] for doc in docs for r in doc["rates"]}
    finite = [float(n) for n in names if n != "inf"]
    return {n: (2 * max(finite, default=1.0) if n == "inf" else float(n)) for n in names}


ITL_QUANTILES = 500          # points of each rate's ITL distribution a compact document keeps


def compact(doc: dict) -> dict:
    """The document without each request's ITL gaps (most of its megabytes), each rate's ITL
    distribution kept as ITL_QUANTILES quantiles instead: small enough for docs/results/, and
    draw() plots it the same."""
    out = {**doc, "paths": {k: _without_itl_lists(v) for k, v in doc["paths"].items()},
           "rates": []}
    for r in doc["rates"]:
        gaps = sorted(g for q in r["requests"] if q["error"] is None for g in q["itl"])
        quantiles = [gaps[min(len(gaps) - 1, round(i * (len(gaps) - 1) / (ITL_QUANTILES - 1)))]
                     for i in range(ITL_QUANTILES)] if gaps else []
        out["rates"].append({**_without_itl_lists(r), "itl_quantiles": quantiles})
    return out


def _without_itl_lists(report: dict) -> dict:
    """A pass's report with its requests' ITL gaps left out."""
    requests = report.get("requests")
    if not isinstance(requests, list):
        return report
    return {**report, "requests": [{k: v for k, v in q.items() if k != "itl"} for q in requests]}


def itl_values(rate: dict) -> list[float]:
    """A rate's ITL gaps in seconds: every one, or a compact document's quantiles."""
    if "itl_quantiles" in rate:
        return rate["itl_quantiles"]
    return [g for q in rate["requests"] if q["error"] is None for g in q["itl"]]


def ecdf(values: list[float]) -> tuple[list[float], list[float]]:
    """(sorted values, their cumulative shares (i + 1) / n)."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plain_numbers(axis) -> None:
    """Label a log axis 20, 50, 200 instead of 2x10^1 ..."""
    import matplotlib.ticker as ticker

    axis.set_major_formatter(ticker.LogFormatter())
    axis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))   # on a short range


def draw(docs: list[dict], labels: list[str], out_dir: str | Path,
         prefix: str = "request_path") -> list[Path]:
    """Both figures of these runs into out_dir; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    xs = rate_positions(docs)
    ticks = sorted(xs.items(), key=lambda kv: kv[1])

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    for k, (doc, name) in enumerate(zip(docs, labels)):
        colour = f"C{k % 10}"
        rates = sorted(doc["rates"], key=lambda r: xs[r["rate"]])
        x = [xs[r["rate"]] for r in rates]
        tput.plot(x, [r["tok_per_s"] for r in rates], "o-", color=colour, label=name)
        offline = doc["paths"].get("offline", {}).get("tok_per_s")
        if offline:
            tput.axhline(offline, color=colour, ls="--", lw=1, label=f"{name}: offline")
        for p, style in (("p50", "o-"), ("p99", "s--")):
            y = [math.nan if r["ttft_ms"][p] is None else r["ttft_ms"][p] for r in rates]
            ttft.plot(x, y, style, color=colour, label=f"{name}: TTFT {p}")
    for ax in (tput, ttft):
        ax.set_xscale("log")
        ax.set_xticks([v for _, v in ticks], [n for n, _ in ticks])
        ax.minorticks_off()
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    tput.set_ylabel("output tok/s")
    tput.set_ylim(bottom=0)
    tput.set_title("throughput against request rate", fontsize=9)
    ttft.set_yscale("log")
    plain_numbers(ttft.yaxis)
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_title("time to first token against request rate", fontsize=9)
    fig.tight_layout()
    rates_png = out_dir / f"{prefix}_rates.png"
    fig.savefig(rates_png, dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    many = len(docs) > 1
    for k, (doc, name) in enumerate(zip(docs, labels)):
        for j, r in enumerate(sorted(doc["rates"], key=lambda r: xs[r["rate"]])):
            ok = [q for q in r["requests"] if q["error"] is None]
            series = ([q["ttft"] * 1000 for q in ok if q["ttft"] is not None],
                      [g * 1000 for g in itl_values(r)])
            style = ["-", "--", ":", "-."][k % 4] if many else "-"
            for ax, values in zip(axes, series):
                if values:
                    x, y = ecdf(values)
                    ax.plot([x[0], *x], [0.0, *y], style, color=f"C{j % 10}",
                            drawstyle="steps-post",
                            label=f"{name}: {r['rate']}/s" if many else f"{r['rate']} req/s")
    for ax, what in zip(axes, ("TTFT", "ITL (gap between chunks)")):
        ax.set_xscale("log")
        plain_numbers(ax.xaxis)
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("share of " + ("requests" if what == "TTFT" else "gaps"))
        ax.set_ylim(0, 1)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"CDF of {what} per request rate", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    cdf_png = out_dir / f"{prefix}_cdf.png"
    fig.savefig(cdf_png, dpi=100)
    plt.close(fig)
    return [rates_png, cdf_png]


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="request-path JSON documents")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "docs"),
                    help="default: the repository's docs/")
    ap.add_argument("--prefix", default="request_path", help="file names: PREFIX_rates.png ...")
    ap.add_argument("--label", action="append", help="a legend name per file, in order")
    ap.add_argument("--compact", metavar="OUT", help="with one file: also write its compact "
                    "form (compact()) to OUT, e.g. docs/results/NAME.json")
    args = ap.parse_args(argv)
    docs = [json.loads(Path(f).read_text()) for f in args.files]
    for f, doc in zip(args.files, docs):
        if doc.get("benchmark") != "request_path":
            ap.error(f"{f}: not a request-path result")
        if not doc["rates"]:
            print(f"{f}: no Poisson rates to plot")
    labels = args.label or [label(doc, f) for doc, f in zip(docs, args.files)]
    if len(labels) != len(docs):
        ap.error("give one --label per file")
    if args.compact:
        if len(docs) != 1:
            ap.error("--compact takes one file")
        Path(args.compact).write_text(json.dumps(compact(docs[0]), separators=(",", ":")))
    paths = draw(docs, labels, args.out_dir, args.prefix)
    for p in paths:
        print(p)
    return paths
