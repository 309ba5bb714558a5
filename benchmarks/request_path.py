"""The request-path benchmark: the reference workload on one engine configuration, three ways in
one run, each throughput with its ratio to offline; then latency under Poisson arrivals.

1. offline: `LLM.generate` on every prompt at once, in a subprocess (its GPU memory is gone
   before the server starts);
2. ZMQ: `conveyor serve` (default flags, plus only those given after `--`) through conveyor's
   `AsyncClient`, every request at once;
3. HTTP: the same server through the official `openai` client (AsyncOpenAI, `/v1/completions`,
   token-id prompts, streamed with usage, ignore_eos), the requests split over --client-procs
   processes (benchmarks/client_pool.py), every request at once; output tokens from usage;
4. the same server over HTTP at each of --rates (Poisson arrivals, requests/s): TTFT, ITL (gaps
   between content chunks), TPOT and end-to-end latency, measured in the client processes as
   vLLM's benchmark_serving does (benchmarks/serving.py's Result and percentiles).

The offline pass runs `LLM` with the engine flags given to the server; what no flag sets takes
each door's own default, as a user gets it (on a GPU: a 16,384-token step budget offline, 8,192
for the server; the JSON records both configurations).

Honesty rules. The workload is 256 requests, prompt and output lengths uniform in [100, 1024],
seed 0 (reference_workload.py; --num-requests, --input-len and --output-len shrink it, for a
CPU). No timed pass finds its prompts in the prefix cache: every pass keeps the lengths and
max_tokens of the seed-0 workload, the offline pass its prompts exactly, and the ZMQ pass, the
HTTP pass and each rate draw their token ids from a stream of their own (salt "zmq", "http",
"rate R"); the warm-ups (short generations, a few length classes, so the Triton kernels compile
before timing) use other prompts again. The first timed run is the one reported: no best-of.
Sampling: temperature 0.6, ignore_eos, max_tokens of the workload.

    python scripts/bench_request_path.py --shape qwen3-0.6b --random-weights
    python scripts/bench_request_path.py --model /path/to/hf-folder -- --max-num-seqs 128
    python scripts/bench_request_path.py --num-requests 16 --input-len 100:256 \\
        --output-len 16:64 --rates 2,8                  # CPU, the default model

Everything goes into one JSON document (--output; its path is printed): device, date, git
revision, the command line, the server flags, the engine arguments, each pass's figures and
every request's latencies (for CDFs: scripts/plot_benchmarks.py). The server's log goes next to
it (.server.log).

Python packages needed beyond conveyor's own (which `conveyor serve` needs: pyzmq, msgspec,
fastapi, uvicorn, ...): openai >= 1.40 (with its own dependencies: httpx, pydantic, anyio,
jiter, sniffio, distro), httpx (the model list), numpy (percentiles); for --shape also
transformers and tokenizers (the model and its synthetic tokenizer).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.client_pool import ClientPool
from benchmarks.reference_workload import salted, warm_up, workload
from benchmarks.serving import Result, arrival_times, first_model, make_report

ROOT = Path(__file__).resolve().parents[1]
PATHS = {"offline": "offline LLM.generate", "zmq": "ZMQ AsyncClient", "http": "HTTP openai"}
SCHEMA = 1


# ---- pure parts: arguments, pass prompts, reports, the document, the tables ----

def parse_range(text: str) -> tuple[int, int]:
    """'LO:HI' -> (LO, HI), 1 <= LO <= HI."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not LO:HI: {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI: {text!r}")
    return lo, hi


def parse_rates(text: str) -> list[float]:
    """'4,16,64' -> [4.0, 16.0, 64.0] (requests/s, > 0; 'inf' for all at once); '' -> []."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0: {text!r}")
    return rates


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def pass_prompts(prompts: list[list[int]], salt: str | None) -> list[list[int]]:
    """The prompts of one timed pass: the seed-0 prompts themselves (salt None: the offline
    pass), else prompts of the same lengths with token ids from salt's stream."""
    return prompts if salt is None else salted(prompts, salt)


def request_latencies(results: list[Result]) -> list[dict]:
    """Every request's figures (seconds, to the microsecond; ITL: every gap), for CDFs."""
    def s(x):
        return None if x is None else round(x, 6)
    return [{"start": s(r.start), "ttft": s(r.ttft), "e2e": s(r.end - r.start), "tpot": s(r.tpot),
             "itl": [s(g) for g in r.itl], "output_tokens": r.tokens,
             "prompt_tokens": r.prompt_tokens, "error": r.error} for r in results]


def http_report(results: list[Result], salt: str, **extra) -> dict:
    """One HTTP pass: counts, output tok/s (first send to last end), latency percentiles in ms
    (benchmarks/serving.py's make_report) and every request's latencies."""
    rep = make_report(results, {}, interrupted=False)
    keep = ("completed", "failed", "errors", "duration_s", "total_input_tokens",
            "total_output_tokens", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
    return {**extra, "salt": salt, "tok_per_s": rep["output_throughput"],
            **{k: rep[k] for k in keep}, "requests": request_latencies(results)}


def add_ratios(doc: dict) -> None:
    """Each path's tok/s as a multiple of the offline pass's (vs_offline)."""
    paths = doc["paths"]
    base = paths.get("offline", {}).get("tok_per_s")
    for p in paths.values():
        p["vs_offline"] = p["tok_per_s"] / base if base else None


def new_document(*, command: str, device: str | None, revision: str | None, dirty: bool | None,
                 model: str | None, server_flags: list[str], engine: dict, workload_info: dict,
                 client_procs: int, rates: list[float], env: dict) -> dict:
    """The JSON document of a run, before any pass has run: `paths` gets offline, zmq and http
    (each with tok_per_s and vs_offline), `rates` one report per rate (http_report)."""
    return {"benchmark": "request_path", "schema": SCHEMA, "complete": False,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": device, "git_revision": revision, "git_dirty": dirty, "command": command,
            "model": model or "default", "server_flags": server_flags, "engine": engine,
            "workload": workload_info, "client_procs": client_procs, "env": env,
            "rates_requested": [rate_name(r) for r in rates], "paths": {}, "rates": []}


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                        enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def tables(doc: dict) -> str:
    """The run in two short tables: path | tok/s | vs offline, and the rates' latencies (ms)."""
    rows = [["path", "tok/s", "vs offline"]]
    for key, label in PATHS.items():
        p = doc["paths"].get(key)
        if p is not None:
            ratio = "-" if p.get("vs_offline") is None else f"{p['vs_offline']:.2f}"
            rows.append([label, f"{p['tok_per_s']:,.1f}", ratio])
    out = [_table(rows)]
    if doc["rates"]:
        rows = [["rate (req/s)", "TTFT p50/p99", "ITL p50/p99", "TPOT p50", "e2e p50/p99",
                 "tok/s"]]
        for r in doc["rates"]:
            t, i, p, e = r["ttft_ms"], r["itl_ms"], r["tpot_ms"], r["e2e_ms"]
            fail = f" ({r['failed']} failed)" if r["failed"] else ""
            rows.append([r["rate"] + fail, f"{_ms(t['p50'])} / {_ms(t['p99'])}",
                         f"{_ms(i['p50'])} / {_ms(i['p99'])}", _ms(p["p50"]),
                         f"{_ms(e['p50'])} / {_ms(e['p99'])}", f"{r['tok_per_s']:,.1f}"])
        out.append("latencies in ms\n" + _table(rows))
    return "\n\n".join(out)


# ---- the passes ----

def git_revision() -> tuple[str | None, bool | None]:
    """(git rev-parse --short HEAD, whether tracked files differ from it), or (None, None)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, timeout=10,
                             capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, timeout=10, capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if rev.returncode != 0 or not rev.stdout.strip():
        return None, None
    return rev.stdout.strip(), bool(dirty.stdout.strip())


def engine_arguments(server_flags: list[str]) -> tuple[dict, bool]:
    """(EngineConfig arguments, skip_tokenizer_init) that `conveyor serve SERVER_FLAGS` runs;
    its parser refuses a bad flag here, before anything is started."""
    from conveyor.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", *server_flags])
    return engine_kwargs(args), args.skip_tokenizer_init


def _offline_child(conn, engine: dict, skip_tokenizer_init: bool, calls, prompts, max_tokens,
                   temperature: float) -> None:
    try:
        conn.send(offline_pass(engine, skip_tokenizer_init, calls, prompts, max_tokens,
                               temperature))
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def offline_pass(engine: dict, skip_tokenizer_init: bool, calls, prompts, max_tokens,
                 temperature: float) -> dict:
    """LLM(**engine): the warm-up's calls (8 tokens each), then every prompt in one generate."""
    import dataclasses

    import torch

    from conveyor import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(skip_tokenizer_init=skip_tokenizer_init, **engine)
    startup = time.perf_counter() - t0
    for batch in calls:
        llm.generate(batch, SamplingParams(temperature=temperature, max_tokens=8),
                     use_tqdm=False)
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)
              for n in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    runner = llm.runner
    on_gpu = runner.device.type == "cuda"
    config = {k: v for k, v in dataclasses.asdict(llm.config).items()
              if isinstance(v, (str, int, float, bool, type(None)))}
    return {"device": torch.cuda.get_device_name(runner.device) if on_gpu else "cpu",
            "salt": None, "requests": len(prompts), "output_tokens": tokens,
            "seconds": elapsed, "tok_per_s": tokens / elapsed, "startup_s": startup,
            "kv_blocks": runner.num_blocks, "config": config}


def run_offline(engine: dict, skip_tokenizer_init: bool, calls, prompts, max_tokens,
                temperature: float) -> dict:
    """offline_pass in a spawned process, which exits (and frees its GPU memory) before this
    returns."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_offline_child, args=(child, engine, skip_tokenizer_init, calls,
                                                    prompts, max_tokens, temperature))
    proc.start()
    child.close()
    try:
        result = parent.recv()
    except EOFError:
        result = {"error": "the offline process died"}
    proc.join()
    if proc.exitcode:
        result.setdefault("error", f"the offline process exited with {proc.exitcode}")
    if "error" in result:
        raise RuntimeError(f"offline pass failed:\n{result['error']}")
    return result


async def zmq_generate_all(address: str, prompts, max_tokens, temperature: float,
                           ignore_eos: bool = True) -> tuple[float, list[tuple[float, int]]]:
    """Every request at once through AsyncClient: (seconds from the first send to the last
    result, [(each request's seconds, its output tokens)])."""
    from conveyor import SamplingParams
    from conveyor.client import AsyncClient

    async with AsyncClient(address) as client:
        async def one(prompt, n):
            start = time.perf_counter()
            out = await client.generate(prompt, SamplingParams(
                temperature=temperature, ignore_eos=ignore_eos, max_tokens=n))
            return time.perf_counter() - start, len(out.outputs[0].token_ids)

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
        return time.perf_counter() - t0, list(done)


def zmq_pass(address: str, prompts, max_tokens, temperature: float, salt: str) -> dict:
    elapsed, done = asyncio.run(zmq_generate_all(address, prompts, max_tokens, temperature))
    tokens = sum(n for _, n in done)
    return {"salt": salt, "requests": len(prompts), "output_tokens": tokens, "seconds": elapsed,
            "tok_per_s": tokens / elapsed, "e2e_s": [round(s, 6) for s, _ in done]}


def warm_server(address: str, calls, temperature: float) -> None:
    """The warm-up's calls through ZMQ, one after another, each call's prompts at once."""
    for batch in calls:
        asyncio.run(zmq_generate_all(address, batch, [8] * len(batch), temperature,
                                     ignore_eos=False))


# ---- the run ----

def parse_args(argv: list[str]) -> argparse.Namespace:
    from benchmarks.models import SHAPES

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [options] [-- conveyor serve flags]")
    ap.add_argument("--model", help="a Hugging Face folder or .gguf (default: conveyor's)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="with --random-weights")
    ap.add_argument("--random-weights", action="store_true",
                    help="build --shape with random weights and a synthetic tokenizer")
    ap.add_argument("--num-layers", type=int, default=None, help="override --shape's layers")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                    help="for --shape: dummy = config.json only, the engine draws the weights "
                         "(default: dummy only if the checkpoint would not fit the disk)")
    ap.add_argument("--device", default=None,
                    help="passed to the engine (serve --device) if given; default: the "
                         "engine's own")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=parse_range, default=(100, 1024), metavar="LO:HI",
                    help="prompt lengths, uniform (default 100:1024)")
    ap.add_argument("--output-len", type=parse_range, default=(100, 1024), metavar="LO:HI",
                    help="max_tokens, uniform (default 100:1024)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--rates", type=parse_rates, default=[4.0, 16.0, 64.0],
                    help="Poisson request rates, comma-separated (default 4,16,64; '' none)")
    ap.add_argument("--client-procs", type=int, default=8,
                    help="HTTP client processes (default 8)")
    ap.add_argument("--request-timeout", type=float, default=3600.0,
                    help="seconds per HTTP request")
    ap.add_argument("--startup-timeout", type=float, default=1800.0,
                    help="seconds for the server to start")
    ap.add_argument("--output", help="the JSON document (default: request_path-DATE.json)")
    ap.add_argument("--revision", help="the git revision to record where git cannot tell")
    args = ap.parse_args(argv)
    if args.num_requests < 1 or args.client_procs < 1:
        ap.error("--num-requests and --client-procs must be >= 1")
    if args.model and args.shape:
        ap.error("give --model or --shape, not both")
    if args.shape and not args.random_weights:
        ap.error("--shape needs --random-weights")
    if not args.shape and (args.num_layers or args.load_format):
        ap.error("--num-layers and --load-format go with --shape")
    args.parser = ap
    return args


def model_flags(args) -> tuple[str | None, list[str]]:
    """(the model to record, serve flags for it): --model, a built --shape, or neither (the
    engine's default model)."""
    if args.model:
        return args.model, ["--model", args.model]
    if not args.shape:
        return None, []
    from concurrent.futures import ProcessPoolExecutor

    from benchmarks.models import random_model

    # NOTE: built in a process of its own: the random init runs on the GPU where there is one,
    # and the CUDA context it leaves would hold GPU memory through every pass
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        path, load_format = pool.submit(random_model, args.shape, args.num_layers,
                                        args.load_format).result()
    extra = ["--load-format", "dummy"] if load_format == "dummy" else []
    return path, ["--model", path, *extra]


def main(argv: list[str] | None = None) -> dict:
    """Run every pass; returns the JSON document (also written to --output).

    NOTE: every process of the run (the offline engine, the server's, the clients) gets
    OMP_WAIT_POLICY=PASSIVE unless the environment sets it: OpenMP threads that spin after each
    op starve the server's other processes where cores are few (in two runs on 2 shared cores,
    the ZMQ path made 0.24 of offline's tok/s with spinning threads, 0.89 without). The value
    is recorded in the JSON."""
    omp = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = omp or "PASSIVE"
    try:
        return _main(argv)
    finally:
        if omp is None:
            del os.environ["OMP_WAIT_POLICY"]


def _main(argv: list[str] | None) -> dict:
    command = shlex.join([Path(sys.executable).name, *sys.argv] if argv is None
                         else ["benchmarks.request_path.main", *argv])
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, extra = parse_args(argv[:split]), argv[split + 1:]
    for flag in ("--port", "--zmq-port", "--model", "--device"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            args.parser.error(f"{flag} after --: the benchmark sets it (give --model or "
                              f"--device before --)")
    model, server_flags = model_flags(args)
    server_flags += (["--device", args.device] if args.device else []) + extra
    engine, skip_tokenizer_init = engine_arguments(server_flags)
    if engine.get("tensor_parallel_size", 1) != 1:
        args.parser.error("--tp: the offline LLM runs one worker; this benchmark compares one "
                          "engine configuration")

    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    prompts, max_tokens = workload(args.num_requests, hi_in, hi_out, min_input=lo_in,
                                   min_output=lo_out)
    reference = (args.num_requests, args.input_len, args.output_len) == (256, (100, 1024),
                                                                         (100, 1024))
    revision, dirty = git_revision()
    doc = new_document(
        command=command, device=None, revision=revision or args.revision,
        dirty=dirty if revision else None, model=model, server_flags=server_flags,
        engine=engine, client_procs=args.client_procs, rates=args.rates,
        env={"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]},
        workload_info={"reference": reference, "seed": 0, "num_requests": len(prompts),
                       "input_len": list(args.input_len), "output_len": list(args.output_len),
                       "prompt_tokens": sum(map(len, prompts)), "max_tokens": sum(max_tokens),
                       "temperature": args.temperature, "ignore_eos": True})
    output = Path(args.output or datetime.now().strftime("request_path-%Y%m%d-%H%M%S.json"))
    log_path = output.with_suffix(".server.log")

    def save() -> None:
        add_ratios(doc)
        # compact: every ITL gap of a full run is about 5 MB this way, twice that indented
        output.write_text(json.dumps(doc, separators=(",", ":"), default=str) + "\n")

    def say(text: str) -> None:
        print(text, flush=True)

    say(f"request path: {len(prompts)} requests "
        f"({'' if reference else 'not '}the reference workload), "
        f"{doc['workload']['prompt_tokens']} prompt tokens, up to {sum(max_tokens)} output "
        f"tokens; model {doc['model']}; serve flags: {shlex.join(server_flags) or '(none)'}")
    offline = run_offline(engine, skip_tokenizer_init, warm_up(prompts, "warm-up offline"),
                          pass_prompts(prompts, None), max_tokens, args.temperature)
    doc["device"] = offline.pop("device")
    doc["paths"]["offline"] = offline
    save()
    say(f"offline: {offline['output_tokens']} tokens in {offline['seconds']:.2f} s = "
        f"{offline['tok_per_s']:,.1f} tok/s (device {doc['device']})")

    from benchmarks.models import serve_process

    with open(log_path, "w") as log, serve_process(
            "--port", "0", "--zmq-port", "0", *server_flags, timeout=args.startup_timeout,
            stderr=log) as line:
        http = re.search(r"http://[\d.]+:\d+", line).group(0)
        zmq = re.search(r"tcp://[\d.]+:\d+", line).group(0)
        warm_server(zmq, warm_up(prompts, "warm-up server"), args.temperature)
        doc["paths"]["zmq"] = zmq_pass(zmq, pass_prompts(prompts, "zmq"), max_tokens,
                                       args.temperature, "zmq")
        save()
        say(f"ZMQ: {doc['paths']['zmq']['tok_per_s']:,.1f} tok/s")
        served_model = first_model(http, {})
        warm = [pass_prompts([[0] * 16], f"http client {k}")[0]
                for k in range(args.client_procs)]
        with ClientPool(args.client_procs) as pool:
            def http_pass(salt: str, offsets: list[float]) -> list[Result]:
                return pool.run(http, served_model, pass_prompts(prompts, salt), max_tokens,
                                offsets, args.temperature, args.request_timeout, warm)

            results = http_pass("http", [0.0] * len(prompts))
            doc["paths"]["http"] = http_report(results, "http")
            save()
            say(f"HTTP ({args.client_procs} client processes): "
                f"{doc['paths']['http']['tok_per_s']:,.1f} tok/s, "
                f"{doc['paths']['http']['failed']} failed")
            for k, rate in enumerate(args.rates):
                salt = f"rate {rate_name(rate)}"
                results = http_pass(salt, arrival_times(len(prompts), rate, seed=k))
                doc["rates"].append(http_report(results, salt, rate=rate_name(rate),
                                                arrival_seed=k))
                save()
                r = doc["rates"][-1]
                say(f"rate {r['rate']}/s: {r['tok_per_s']:,.1f} tok/s, TTFT p50 "
                    f"{_ms(r['ttft_ms']['p50'])} ms, {r['failed']} failed")
    doc["complete"] = True
    save()
    say("\n" + tables(doc))
    say(f"\nresults: {output} (server log: {log_path})")
    return doc
