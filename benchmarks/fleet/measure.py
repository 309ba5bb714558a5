"""Measure a step's cost on this machine: the real engine over a grid of step shapes, then fit.

Runs conveyor's engine in process (the scheduler and one model runner; overlap off, so each
`EngineCore.step()` is one step: plan, run, apply) on random token ids, and times every step of
a grid of small workloads: single prompts (prefill steps), batches of D prompts of C tokens
decoding a few tokens (prefill, then decode steps of D sequences over contexts of about C), and
a prompt arriving while 16 sequences decode (mixed steps). Each step's shape comes from the plan
the scheduler made; shapes met more than once keep their median time. cost.fit then gives the
cost file the simulator reads.

`copies` measuring processes run at once, each with threads torch threads: a data-parallel
replica on a shared CPU computes beside the others, and that is the cost it pays (the memory
bandwidth is shared). Samples of all copies are fitted together.
"""
from __future__ import annotations

import json
import multiprocessing
import random
import statistics
import time

from benchmarks.fleet.cost import CostModel, StepShape, fit, part_features

CPU_GRID = {"prefill": [16, 64, 256, 1024], "batches": [1, 2, 4, 16], "contexts": [64, 256],
            "decode_steps": 3}
CUDA_GRID = {"prefill": [16, 64, 256, 512, 1024, 2048, 4096, 8192],
             "batches": [1, 8, 32, 64, 128, 256], "contexts": [128, 1024, 2048], "decode_steps": 4}


def measure_steps(engine_args: dict, grid: dict, threads: int | None, seed: int
                  ) -> tuple[list[tuple[StepShape, float]], dict]:
    """Every timed step of the grid as (shape, seconds), and the engine's settings."""
    import torch

    from conveyor import LLM, SamplingParams
    from conveyor.shared.messages.engine import AddRequest

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(skip_tokenizer_init=True, async_scheduling=False, enable_prefix_caching=False,
              **engine_args)
    engine, sched = llm.engine, llm.engine.scheduler
    rnd = random.Random(seed)
    ids = iter(range(1 << 62))
    shapes: list[StepShape] = []
    schedule = sched.schedule

    def recording_schedule():
        plan = schedule()
        if plan is not None:
            # NOTE: the parts of the plan just made, with where each one starts
            parts = sched._in_flight[-1][1]
            kv = attn = 0
            for p in parts:
                k, a = part_features(p.end - p.step.num_tokens, p.step.num_tokens)
                kv, attn = kv + k, attn + a
            shapes.append(StepShape(sum(p.step.num_tokens for p in parts),
                                    sum(p.step.sample for p in parts), kv, attn))
        return plan

    sched.schedule = recording_schedule

    def add(prompt_len: int, max_tokens: int) -> None:
        engine.add(AddRequest(id=f"{next(ids)}/0",
                              token_ids=[rnd.randrange(10, 30000) for _ in range(prompt_len)],
                              sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                      temperature=0.0)))

    samples: list[tuple[StepShape, float]] = []

    def run(record: bool = True, until_idle: bool = True, steps: int = 0) -> None:
        while engine.has_work() if until_idle else steps > 0:
            before = len(shapes)
            t0 = time.perf_counter()
            engine.step()
            took = time.perf_counter() - t0
            if record and len(shapes) == before + 1:
                samples.append((shapes[-1], took))
            steps -= 1

    add(32, 4)                                       # warm-up
    run(record=False)
    limit = llm.runner.max_model_len
    for n in grid["prefill"]:
        if n < limit:
            add(n, 1)
            run()
    for c in grid["contexts"]:
        for d in grid["batches"]:
            for _ in range(d):
                add(min(c, limit - 16), grid["decode_steps"] + 1)
            run()
    for _ in range(16):                              # mixed steps: a prompt joins 16 decodes
        add(128, 12)
    run(until_idle=False, steps=3)
    for n in grid["prefill"][:3]:
        add(n, 1)
        run(until_idle=False, steps=2)
    run()
    c = llm.config
    settings = {"block_size": c.block_size, "max_num_batched_tokens": c.max_num_batched_tokens,
                "max_num_seqs": c.max_num_seqs, "num_blocks": llm.runner.num_blocks,
                "device": c.device, "model": c.model, "threads": torch.get_num_threads()}
    return samples, settings


def _child(conn, engine_args: dict, grid: dict, threads: int | None, seed: int) -> None:
    try:
        samples, settings = measure_steps(engine_args, grid, threads, seed)
        conn.send_bytes(json.dumps({"samples": [[*_fields(s), t] for s, t in samples],
                                    "settings": settings}).encode())
    except BaseException as e:           # the parent reports it
        conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        raise


def _fields(s: StepShape) -> list:
    return [s.tokens, s.seqs, s.kv, s.attn]


def measure(name: str, engine_args: dict, grid: dict, threads: int | None = None,
            copies: int = 1, seed: int = 0) -> tuple[CostModel, list[tuple[StepShape, float]]]:
    """Measure in `copies` processes at once and fit one cost model to all their steps."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for k in range(copies):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(child, engine_args, grid, threads, seed + k))
        p.start()
        child.close()
        procs.append((p, parent))
    docs = []
    for p, conn in procs:
        try:
            docs.append(json.loads(conn.recv_bytes()))
        except EOFError:
            docs.append({"error": "the measuring process died"})
        p.join()
    errors = [d["error"] for d in docs if "error" in d]
    if errors:
        raise RuntimeError(f"measuring failed: {errors[0]}")
    by_shape: dict[tuple, list[float]] = {}
    for d in docs:
        for *f, t in d["samples"]:
            by_shape.setdefault(tuple(f), []).append(t)
    samples = [(StepShape(*f), statistics.median(ts)) for f, ts in by_shape.items()]
    knots, c_seq, c_kv, c_attn = fit(samples)
    s = docs[0]["settings"]
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    return CostModel(
        name=name, knots=knots, c_seq=c_seq, c_kv=c_kv, c_attn=c_attn,
        block_size=s["block_size"], max_num_batched_tokens=s["max_num_batched_tokens"],
        max_num_seqs=s["max_num_seqs"], async_scheduling=True, num_blocks=s["num_blocks"],
        source=(f"measured: {len(samples)} step shapes of {s['model'] or 'the default model'} "
                f"on {s['device']}, {copies} measuring process(es) at once with "
                f"{s['threads']} torch thread(s) each, {when} UTC")
    ), samples


def save_with_samples(model: CostModel, samples, path: str) -> None:
    doc = model.to_json()
    doc["samples"] = [[*_fields(s), t] for s, t in samples]
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

