"""Serving benchmark against any OpenAI-compatible HTTP server (conveyor serve, vLLM, SGLang...).

Sends --num-prompts streamed requests with Poisson arrivals (--request-rate, `inf` = all at once)
and/or at most --max-concurrency in flight, and measures on the client, per request: time to
first content chunk (TTFT), gaps between content chunks (ITL), (e2e - TTFT) / (tokens - 1) (TPOT)
and end-to-end latency; output tokens come from the final `usage` chunk (else one per chunk).
Failed requests are counted, not fatal; Ctrl-C reports what was measured so far.

    python scripts/bench_serving.py --num-prompts 200 --request-rate 4 --random-input-len 1024
    python scripts/bench_serving.py --sweep 1,2,4,8,inf --output runs.jsonl --plot latency.png

A mixed workload (--interactive-share) makes that share of the requests interactive: their own
lengths, a time-to-first-token objective sent as `ttft_slo` (conveyor's extra field) and
optionally a `priority`; the report then gives each class's TTFT and the share of its requests
that met the objective (failed ones count as misses). scripts/bench_policies.py sweeps loads and
scheduling policies with it.

NOTE: in a sweep the random dataset is redrawn for each rate (seed + k), so no rate gains from
prefix-cache hits on the prompts of the previous one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which "
         "this be or has had one first new after who their two its also time year between into "
         "state city world river music house school team light water north south system market "
         "history during under people number film game small large early later began known "
         "since three part family member council series album station church court island "
         "village company language building season because though against around while").split()


@dataclass
class Request:
    prompt: str | list[int] | None = None      # completions: text or token ids
    messages: list[dict] | None = None         # chat
    max_tokens: int | None = None
    interactive: bool = False                  # of the mixed workload's interactive class


@dataclass
class Result:
    start: float
    end: float = 0.0
    ttft: float | None = None                  # seconds from send to the first content chunk
    itl: list[float] = field(default_factory=list)
    chunks: int = 0                            # content-bearing chunks
    last: float = 0.0                          # when the latest content chunk came
    output_tokens: int | None = None           # from usage, when the server sent it
    prompt_tokens: int | None = None
    error: str | None = None
    interactive: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.end - self.start - self.ttft) / (self.tokens - 1)

    def on_event(self, data: str, endpoint: str, now: float) -> bool:
        """Account one SSE data payload received at `now`; False once the stream is over."""
        if data.strip() == "[DONE]":
            return False
        obj = json.loads(data)
        if "error" in obj:
            self.error = f"error event: {error_message(obj)}"[:300]
            return False
        self.on_chunk(chunk_text(obj, endpoint), obj.get("usage"), now)
        return True

    def on_chunk(self, text: str, usage: dict | None, now: float) -> None:
        """Account one streamed chunk received at `now`: its generated text ("" for none) and
        its usage ({"completion_tokens", "prompt_tokens"}, or None)."""
        if usage:
            self.output_tokens = usage.get("completion_tokens")
            self.prompt_tokens = usage.get("prompt_tokens")
        if text:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.last, self.chunks = now, self.chunks + 1


# ---- pure parts: schedule, datasets, SSE, statistics ----

def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds from the start: 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def length_bounds(length: int, ratio: float) -> tuple[int, int]:
    lo = max(1, int(length * (1 - ratio)))
    return lo, max(lo, int(length * (1 + ratio)))


def random_requests(n: int, input_len: int, output_len: int, ratio: float, endpoint: str,
                    seed: int | str, min_id: int = 100, max_id: int = 10000) -> list[Request]:
    """Token-id prompts for completions, prompts of random words for chat; lengths uniform in
    [len * (1 - ratio), len * (1 + ratio)]."""
    rng = random.Random(seed)
    in_lo, in_hi = length_bounds(input_len, ratio)
    out_lo, out_hi = length_bounds(output_len, ratio)
    requests = []
    for _ in range(n):
        k, max_tokens = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        if endpoint == "chat":
            text = " ".join(rng.choice(WORDS) for _ in range(k))
            requests.append(Request(messages=[{"role": "user", "content": text}],
                                    max_tokens=max_tokens))
        else:
            requests.append(Request(prompt=[rng.randint(min_id, max_id) for _ in range(k)],
                                    max_tokens=max_tokens))
    return requests


def mix_interactive(requests: list[Request], share: float, seed: int | str,
                    replacements: list[Request] | None = None) -> list[Request]:
    """`requests` with round(share * len) of them, at seeded positions, made interactive:
    replaced in turn by `replacements` if given, else as they are."""
    rng = random.Random(f"mix-{seed}")
    chosen = sorted(rng.sample(range(len(requests)), round(share * len(requests))))
    out = list(requests)
    for j, i in enumerate(chosen):
        req = replacements[j] if replacements is not None else requests[i]
        out[i] = Request(req.prompt, req.messages, req.max_tokens, interactive=True)
    return out


def load_jsonl(path: str, default_max_tokens: int | None = None) -> list[Request]:
    """One request a line: {"prompt": str | [int], "max_tokens"?} or {"messages": [...], ...}."""
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if "prompt" not in obj and "messages" not in obj:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'messages'")
            requests.append(Request(prompt=obj.get("prompt"), messages=obj.get("messages"),
                                    max_tokens=obj.get("max_tokens", default_max_tokens)))
    return requests


class SSEDecoder:
    """Incremental server-sent-events decoder: feed() the bytes as they arrive (lines may be split
    anywhere) and get back the `data` of each completed event; comments and other fields are
    skipped. close() returns an event left unterminated at the end of the stream."""

    def __init__(self):
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        events = (self._line(line.rstrip(b"\r").decode(errors="replace")) for line in lines)
        return [e for e in events if e is not None]

    def close(self) -> list[str]:
        events = self.feed(b"\n") + self.feed(b"\n")
        self._buffer = b""
        return events

    def _line(self, line: str) -> str | None:
        if not line:                                # a blank line ends the event
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        name, _, value = line.partition(":")
        if name == "data":                          # name == "" is a comment (keepalive)
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def chunk_text(obj: dict, endpoint: str) -> str:
    """The generated text in one streamed chunk ("" for a usage-only chunk). A server without a
    tokenizer streams token ids instead (vLLM's and conveyor's `token_ids`): they count too."""
    choices = obj.get("choices") or [{}]
    ids = choices[0].get("token_ids")
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        text = "".join(delta.get(k) or "" for k in ("content", "reasoning_content", "reasoning"))
    else:
        text = choices[0].get("text") or ""
    return text or (" ".join(map(str, ids)) if ids else "")


def error_message(obj) -> str:
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def summarize(values: list[float], scale: float = 1000.0) -> dict:
    """mean, p50, p90, p99 of `values` times `scale` (seconds -> ms); None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


# ---- the client ----

def payload(req: Request, endpoint: str, model: str, args) -> dict:
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        if req.messages is None and not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs 'messages' or a text prompt")
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    elif req.prompt is None:
        raise ValueError("the completions endpoint needs 'prompt' (use --endpoint chat)")
    else:
        body["prompt"] = req.prompt
    if req.max_tokens is None:
        del body["max_tokens"]
    if args.ignore_eos:
        body["ignore_eos"] = True
    if req.interactive and args.interactive_ttft_slo is not None:
        body["ttft_slo"] = args.interactive_ttft_slo
    if req.interactive and args.interactive_priority is not None:
        body["priority"] = args.interactive_priority
    if not (req.interactive or getattr(args, "batch_stream", True)):
        body["stream"] = False
        del body["stream_options"]
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, endpoint: str) -> Result:
    """One request, streamed unless body says otherwise; never raises (but for cancellation):
    errors land in Result.error. An unstreamed request has no TTFT, only its end."""
    r = Result(start=time.perf_counter())
    try:
        if not body["stream"]:
            resp = await client.post(url, json=body)
            obj = resp.json()
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {error_message(obj)[:300]}"
            else:
                r.output_tokens = obj["usage"]["completion_tokens"]
                r.prompt_tokens = obj["usage"]["prompt_tokens"]
            return r
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    text = error_message(json.loads(text))
                except ValueError:
                    pass
                r.error = f"HTTP {resp.status_code}: {text[:300]}"
                return r
            decoder = SSEDecoder()
            async for raw in resp.aiter_bytes():
                now = time.perf_counter()
                if not all(r.on_event(data, endpoint, now) for data in decoder.feed(raw)):
                    break
            else:                                   # the stream ended without [DONE]
                all(r.on_event(data, endpoint, time.perf_counter()) for data in decoder.close())
            if r.ok and r.ttft is None:
                r.error = "no content received"
    except Exception as e:                      # a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        r.end = time.perf_counter()
        if r.prompt_tokens is None and isinstance(body.get("prompt"), list):
            r.prompt_tokens = len(body["prompt"])
    return r


async def benchmark(client, url: str, bodies: list[dict], endpoint: str, rate: float,
                    max_concurrency: int | None, seed: int, timeout: float,
                    results: list[Result], interactive: list[bool] | None = None) -> None:
    """Send `bodies` on the arrival schedule; append each finished Result to `results`
    (marked interactive where `interactive` says so)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    offsets = arrival_times(len(bodies), rate, seed)
    t0 = time.perf_counter()

    async def one(offset: float, body: dict, kind: bool) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        if limit:
            await limit.acquire()
        try:
            r = await asyncio.wait_for(send(client, url, body, endpoint), timeout)
        except asyncio.TimeoutError:
            r = Result(start=time.perf_counter() - timeout, end=time.perf_counter(),
                       error=f"timeout after {timeout} s")
        finally:
            if limit:
                limit.release()
        r.interactive = kind
        results.append(r)

    kinds = interactive or [False] * len(bodies)
    await asyncio.gather(*(one(o, b, k) for o, b, k in zip(offsets, bodies, kinds)))


def make_report(results: list[Result], settings: dict, interrupted: bool) -> dict:
    ok = [r for r in results if r.ok]
    duration = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    out_tokens = sum(r.tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    report = {**settings, "interrupted": interrupted, "duration_s": duration,
              "completed": len(ok), "failed": len(results) - len(ok),
              "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
              "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
              "request_throughput": per_s(len(ok)), "output_throughput": per_s(out_tokens),
              "total_token_throughput": per_s(in_tokens + out_tokens),
              "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None]),
              "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None]),
              "itl_ms": summarize([g for r in ok for g in r.itl]),
              "e2e_ms": summarize([r.end - r.start for r in ok])}
    if settings.get("interactive_share"):
        slo = settings.get("interactive_ttft_slo")
        report["classes"] = {
            "interactive": class_report([r for r in results if r.interactive], slo),
            "batch": class_report([r for r in results if not r.interactive], None)}
    return report


def class_report(results: list[Result], slo: float | None) -> dict:
    """One class of a mixed workload: its TTFT, and the share of its requests whose first token
    came within `slo` seconds (a failed request missed it)."""
    ok = [r for r in results if r.ok]
    met = sum(r.ttft is not None and r.ttft <= slo for r in ok) if slo is not None else None
    return {"requests": len(results), "completed": len(ok), "ttft_ms": summarize(
        [r.ttft for r in ok if r.ttft is not None]), "slo_attainment": (met / len(results)
                                                  if met is not None and results else None)}


def print_report(rep: dict) -> None:
    print(f"---- rate {rep['request_rate']} req/s, "
          f"concurrency {rep['max_concurrency'] or 'unlimited'}, "
          f"{rep['endpoint']} {rep['model']}{' (interrupted)' if rep['interrupted'] else ''}")
    print(f"completed / failed        {rep['completed']} / {rep['failed']}")
    for error, n in rep["errors"].items():
        print(f"  {n} x {error}")
    print(f"duration                  {rep['duration_s']:.2f} s")
    print(f"request throughput        {rep['request_throughput']:.2f} req/s")
    print(f"output throughput         {rep['output_throughput']:,.1f} tok/s")
    print(f"total token throughput    {rep['total_token_throughput']:,.1f} tok/s")
    print(f"{'ms':10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        cells = ["-" if v is None else f"{v:.1f}" for v in rep[f"{name}_ms"].values()]
        print(f"{name.upper():10}" + "".join(f"{c:>10}" for c in cells))
    for kind, c in rep.get("classes", {}).items():
        ttft = c["ttft_ms"]
        met = ("" if c["slo_attainment"] is None else
               f", TTFT <= {rep['interactive_ttft_slo']:g} s: {c['slo_attainment']:.0%}")
        p50 = "-" if ttft["p50"] is None else f"{ttft['p50']:.0f}"
        p99 = "-" if ttft["p99"] is None else f"{ttft['p99']:.0f}"
        print(f"{kind:12} {c['completed']}/{c['requests']} completed, TTFT p50 {p50} ms, "
              f"p99 {p99} ms{met}")


def plot(reports: list[dict], path: str) -> None:
    """TTFT and TPOT p50/p99 (log ms) against offered request rate; output tok/s on the right.
    `inf` sits at the right end under a labelled tick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    finite = [float(r["request_rate"]) for r in reports if r["request_rate"] != "inf"]
    inf_x = 2 * max(finite) if finite else 1.0
    xs = [inf_x if r["request_rate"] == "inf" else float(r["request_rate"]) for r in reports]
    order = sorted(range(len(xs)), key=xs.__getitem__)
    xs = [xs[i] for i in order]
    reports = [reports[i] for i in order]

    def series(key, p):
        return [math.nan if r[key][p] is None else r[key][p] for r in reports]

    fig, ax = plt.subplots(figsize=(8, 5))
    for key, p, style in [("ttft_ms", "p50", "C0o-"), ("ttft_ms", "p99", "C0o--"),
                          ("tpot_ms", "p50", "C1s-"), ("tpot_ms", "p99", "C1s--")]:
        ax.plot(xs, series(key, p), style, label=f"{key[:4].upper()} {p}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{r['request_rate']:g}" if r["request_rate"] != "inf" else "inf"
                       for r in reports])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.grid(True, which="both", alpha=0.3)
    right = ax.twinx()
    right.plot(xs, [r["output_throughput"] for r in reports], "k^:", label="output tok/s")
    right.set_ylabel("output throughput (tok/s)")
    right.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    r0 = reports[0]
    data = (f"random in {r0['random_input_len']} / out {r0['random_output_len']}"
            if r0["dataset"] == "random" else r0["dataset"])
    ax.set_title(f"{r0['model']}: {r0['endpoint']}, "
                 f"concurrency {r0['max_concurrency'] or 'unlimited'}, {data}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def first_model(base: str, headers: dict) -> str:
    resp = httpx.get(f"{base}/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_all(args, base: str, headers: dict, model: str, rates: list[float],
                  reports: list[dict]) -> None:
    url = f"{base}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    revision = git_revision()
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        for req in warmup_requests(args):
            r = await send(client, url, payload(req, args.endpoint, model, args), args.endpoint)
            if not r.ok:
                print(f"warm-up request failed: {r.error}", file=sys.stderr)
        for k, rate in enumerate(rates):
            requests = dataset(args, k)
            bodies = [payload(req, args.endpoint, model, args) for req in requests]
            settings = {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "git_revision": revision, "base_url": base, "model": model,
                "endpoint": args.endpoint, "dataset": args.dataset,
                "request_rate": "inf" if math.isinf(rate) else rate,
                "max_concurrency": args.max_concurrency, "num_prompts": len(bodies),
                "random_input_len": args.random_input_len,
                "random_output_len": args.random_output_len,
                "random_range_ratio": args.random_range_ratio, "ignore_eos": args.ignore_eos,
                "temperature": args.temperature, "seed": args.seed + k,
                "interactive_share": args.interactive_share,
                "interactive_ttft_slo": args.interactive_ttft_slo,
                "interactive_priority": args.interactive_priority,
                "interactive_input_len": args.interactive_input_len,
                "interactive_output_len": args.interactive_output_len,
                "batch_stream": args.batch_stream}
            print(f"rate {settings['request_rate']}: {len(bodies)} requests", flush=True)
            results: list[Result] = []
            finished = False
            try:
                await benchmark(client, url, bodies, args.endpoint, rate, args.max_concurrency,
                                args.seed + k, args.timeout, results,
                                [req.interactive for req in requests])
                finished = True
            finally:                                # also on Ctrl-C: report the partial run
                reports.append(make_report(results, settings, interrupted=not finished))
                print_report(reports[-1])
                if args.output:
                    with open(args.output, "a") as f:
                        f.write(json.dumps(reports[-1]) + "\n")


def dataset(args, k: int) -> list[Request]:
    seed = args.seed + k
    if args.dataset != "random":
        requests = load_jsonl(args.dataset, args.random_output_len)[:args.num_prompts]
        return mix_interactive(requests, args.interactive_share, seed)
    requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.endpoint, seed, args.random_min_id,
                               args.random_max_id)
    interactive = random_requests(
        round(args.interactive_share * len(requests)), args.interactive_input_len,
        args.interactive_output_len, args.random_range_ratio, args.endpoint, f"interactive-{seed}",
        args.random_min_id, args.random_max_id)
    return mix_interactive(requests, args.interactive_share, seed, interactive)


def warmup_requests(args) -> list[Request]:
    """Like the dataset's (fresh random prompts, or its first lines), 16 output tokens."""
    if args.dataset == "random":
        return random_requests(args.warmup, args.random_input_len, 16, 0.0, args.endpoint,
                               f"warmup-{args.seed}", args.random_min_id, args.random_max_id)
    return [Request(r.prompt, r.messages, 16) for r in load_jsonl(args.dataset)[:args.warmup]]


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="default: the first id from GET /v1/models")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests/s, Poisson arrivals; inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    ap.add_argument("--sweep", help="comma-separated request rates, e.g. 0.5,1,2,inf")
    ap.add_argument("--dataset", default="random", help="'random' or a JSONL file")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128,
                    help="also the max_tokens of JSONL lines that give none")
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--random-min-id", type=int, default=100)
    ap.add_argument("--random-max-id", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests, not counted")
    ap.add_argument("--output", help="append each run's result as a JSON line to this file")
    ap.add_argument("--plot", help="write a latency-vs-load PNG here")
    mix = ap.add_argument_group("mixed workload")
    mix.add_argument("--interactive-share", type=float, default=0.0,
                     help="share of interactive requests (0: one class)")
    mix.add_argument("--interactive-ttft-slo", type=float, default=1.0, metavar="SECONDS",
                     help="their time-to-first-token objective, sent as ttft_slo")
    mix.add_argument("--interactive-priority", type=int, default=None,
                     help="their priority (sent only if given; batch requests send none)")
    mix.add_argument("--batch-stream", action=argparse.BooleanOptionalAction, default=True,
                     help="stream the batch (not interactive) requests (--no-batch-stream: one "
                          "response each, as a batch job reads them; no TTFT is measured)")
    mix.add_argument("--interactive-input-len", type=int, default=None,
                     help="random dataset: their prompt length (default: --random-input-len)")
    mix.add_argument("--interactive-output-len", type=int, default=None,
                     help="random dataset: their max_tokens (default: --random-output-len)")
    args = ap.parse_args(argv)
    args.interactive_input_len = args.interactive_input_len or args.random_input_len
    args.interactive_output_len = args.interactive_output_len or args.random_output_len
    try:
        args.rates = ([float(x) for x in args.sweep.split(",")] if args.sweep
                      else [args.request_rate])
    except ValueError:
        ap.error(f"--sweep: not a list of numbers: {args.sweep}")
    if any(not rate > 0 for rate in args.rates):
        ap.error("request rates must be > 0 (inf for all at once)")
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        ap.error("--num-prompts and --max-concurrency must be >= 1")
    if not 0 <= args.random_range_ratio < 1 or args.random_min_id > args.random_max_id:
        ap.error("need 0 <= --random-range-ratio < 1 and --random-min-id <= --random-max-id")
    if not 0 <= args.interactive_share <= 1 or not args.interactive_ttft_slo > 0:
        ap.error("need 0 <= --interactive-share <= 1 and --interactive-ttft-slo > 0")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark once per rate; returns the reports (each appended to --output as a
    JSON line as soon as its run ends)."""
    args = parse_args(argv)
    base = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or first_model(base, headers)
    except (httpx.HTTPError, LookupError, ValueError) as e:
        sys.exit(f"cannot list the models at {base}/v1/models ({e}); give --model")
    reports: list[dict] = []
    try:
        asyncio.run(run_all(args, base, headers, model, args.rates, reports))
    except KeyboardInterrupt:
        print("interrupted: reporting what was measured", file=sys.stderr)
    except ValueError as e:                         # a dataset line the endpoint cannot take
        sys.exit(f"error: {e}")
    if args.plot and reports:
        plot(reports, args.plot)
    return reports


if __name__ == "__main__":
    main()
