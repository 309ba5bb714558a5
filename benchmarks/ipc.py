"""What the process split costs: per-step scheduler -> worker -> scheduler round trip over ipc://
(encode, send, decode, a stub worker's reply) and bytes per step on decode-only steps, then
offline throughput through `conveyor serve` versus the in-process LLM on the same workload.

    .venv/bin/python scripts/bench_ipc.py [--steps 2000] [--requests 64] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import sys
import time

import zmq

from conveyor.shared.messages import decode, encode
from conveyor.shared.messages.worker import SeqStep, StepPlan, StepResult
from conveyor.shared.sockets import Socket, ipc, make_runtime_dir, remove_runtime_dir


def stub_worker(runtime_dir: str) -> None:
    """Decodes each plan and answers with one sampled token per sequence, as rank 0 would."""
    ctx = zmq.Context()
    plans = Socket(ctx, zmq.PULL, ipc(runtime_dir, "plans"), bind=False, allowed=(StepPlan,))
    results = Socket(ctx, zmq.PUSH, ipc(runtime_dir, "results"), bind=False)
    while True:
        _, plan = plans.recv()
        if not plan.seqs:
            return
        results.send(StepResult(plan.step, [7] * len(plan.seqs), [None] * len(plan.seqs), []))


def round_trip(batch: int, steps: int) -> tuple[float, float, int]:
    runtime_dir = make_runtime_dir()
    ctx = zmq.Context()
    plans = Socket(ctx, zmq.PUSH, ipc(runtime_dir, "plans"), bind=True)
    results = Socket(ctx, zmq.PULL, ipc(runtime_dir, "results"), bind=True, allowed=(StepResult,))
    proc = mp.get_context("spawn").Process(target=stub_worker, args=(str(runtime_dir),))
    proc.start()
    times, nbytes = [], 0
    try:
        for step in range(steps + 50):
            # a decode step; every 16th token a sequence gets a new block
            seqs = [SeqStep(i, 1, [1000 + i] if (step + i) % 16 == 0 else [], True)
                    for i in range(batch)]
            start = time.perf_counter()
            frames = encode(StepPlan(step, [], seqs, []))
            plans.send_frames(frames)
            reply = results.sock.recv_multipart()
            decode(reply, (StepResult,))
            if step >= 50:
                times.append(time.perf_counter() - start)
                nbytes += sum(len(f) for f in frames) + sum(len(f) for f in reply)
        plans.send(StepPlan(0, [], [], []))
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
        ctx.destroy(linger=0)
        remove_runtime_dir(runtime_dir)
    return statistics.mean(times) * 1e3, statistics.median(times) * 1e3, nbytes // steps


def throughput(requests: int, max_tokens: int) -> tuple[float, float]:
    from conveyor import LLM, SamplingParams
    from conveyor.client import Client

    engine = ["--max-num-seqs", str(requests), "--kv-cache-memory-bytes", str(128 << 20),
              "--max-model-len", "512"]
    prompts = [f"Request {i}: tell me about the number {i}." for i in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(max_num_seqs=requests, kv_cache_memory_bytes=128 << 20, max_model_len=512)
    llm.generate(prompts[:2], params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    in_process = requests * max_tokens / (time.perf_counter() - start)
    del llm
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", "--zmq-port", "0",
                             *engine], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        address = line.split("serving on ")[1].split()[0].rstrip(",")
        with Client(address, timeout=600) as client:
            client.generate(prompts[:2], params)
            start = time.perf_counter()
            client.generate(prompts, params)
            served = requests * max_tokens / (time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait(30)
    return in_process, served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    print("| batch | round trip mean (ms) | median (ms) | bytes per step |")
    print("|---:|---:|---:|---:|")
    for batch in (1, 64, 256):
        mean, median, nbytes = round_trip(batch, args.steps)
        print(f"| {batch} | {mean:.3f} | {median:.3f} | {nbytes} |", flush=True)
    if not args.skip_throughput:
        in_process, served = throughput(args.requests, args.max_tokens)
        print(f"\noffline decode throughput, {args.requests} requests x {args.max_tokens} "
              f"tokens: in-process {in_process:.0f} tok/s, through processes {served:.0f} tok/s")


if __name__ == "__main__":
    main()
