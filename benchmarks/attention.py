"""Paged attention over a bf16 and an fp8 (e4m3) KV pool, on CUDA: GPU time per call of one
layer's attention and the KV bytes it reads, for decode batches and a prefill chunk.

Decodes are memory-bound: the fp8 pool reads half the bytes, so the goal is close to half the
time. The prefill row shows what converting fp8 tiles to fp16 in registers costs where the
kernel is compute-bound. Each figure: CALLS calls in one CUDA graph over as many copies of the
pool as keep the working set at 4x the L2, median of REPS replays (scripts/bench_kernels.py).

The second table takes the reference workload's own decode batches (scripts/bench_throughput.py):
at decode step S the requests still running, each with its prompt plus S tokens of context, in
the order the scheduler admitted them and longest first (the order the runner gives the kernel,
seq_order), so that the effect of the grid's last wave shows.

    python scripts/bench_attention.py [--shapes llama3.1-8b] [--context 1024] [--no-workload]
"""
from __future__ import annotations

import argparse
import functools
import math

import torch

from benchmarks.kernel_timings import CALLS, copies, graph_us
from benchmarks.reference_workload import workload
from conveyor.kernels.paged_attention import default_num_splits, paged_attention
from conveyor.kernels.store_kv import store_kv

# heads, kv heads, head_dim of one layer
SHAPES = {"qwen3-0.6b": (16, 8, 128), "llama3.1-8b": (32, 8, 128)}
BLOCK = 16
K_SCALE, V_SCALE = 0.05, 0.02        # any positive scales: the time does not depend on them


def make_pool(contexts: list[int], kv_heads: int, head_dim: int, fp8: bool):
    """A pool holding one context of each length, written through store_kv; its block tables."""
    per_seq = [math.ceil(c / BLOCK) for c in contexts]
    blocks = sum(per_seq)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = torch.empty(blocks, 2, BLOCK, kv_heads, head_dim, dtype=dtype, device="cuda")
    ids = torch.randperm(blocks, device="cuda", dtype=torch.int64)
    width = max(per_seq)
    used = torch.arange(width) < torch.tensor(per_seq)[:, None]    # [seqs, width], row-major
    tables = torch.zeros(len(contexts), width, dtype=torch.int64, device="cuda")
    tables[used.cuda()] = ids
    for s in range(0, blocks, 4096):    # write every block once, like prefills would
        slots = (ids[s:s + 4096, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten()
        k = torch.randn(slots.numel(), kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        scales = (K_SCALE, V_SCALE) if fp8 else (1.0, 1.0)
        store_kv(k, k, cache, slots, *scales)
    return cache, tables.int()


def bench(shape: str, contexts: list[int], q_len: int, fp8: bool, ordered: bool = False
          ) -> tuple[float, int]:
    """GPU us per call and KV bytes read; ordered: decodes longest first (seq_order)."""
    heads, kvh, d = SHAPES[shape]
    num_seqs = len(contexts)
    cache, tables = make_pool(contexts, kvh, d, fp8)
    nbytes = 2 * sum(contexts) * kvh * d * cache.element_size()
    pools = [cache] + [cache.clone() for _ in range(copies(nbytes) - 1)]
    t = num_seqs * q_len
    q = torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, t + 1, q_len, dtype=torch.int32, device="cuda")
    order = torch.argsort(seq_lens, descending=True, stable=True).int() if ordered else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = default_num_splits(num_seqs, kvh, sms) if q_len == 1 else 1
    out = torch.empty_like(q)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if fp8 else {}
    calls = [functools.partial(paged_attention, q, pools[i % len(pools)], tables, seq_lens,
                               starts, d ** -0.5, q_len, out=out, num_splits=splits,
                               seq_order=order, **scales)
             for i in range(CALLS)]
    return graph_us(calls), nbytes


def workload_table(shapes: list[str]) -> None:
    prompts, max_tokens = workload()
    prompt_lens = [len(p) for p in prompts]
    print("\nThe reference workload's decode batches (context = prompt + step), admission order "
          "against longest first; GPU us per call (GB/s)")
    print("| shape | pool | step | batch | admission order | longest first | gain |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape in shapes:
        for fp8 in (False, True):
            for step in (0, 200, 400, 600, 800):
                ctx = [p + step for p, n in zip(prompt_lens, max_tokens) if n > step]
                (a, nb), (o, _) = (bench(shape, ctx, 1, fp8, ordered) for ordered in (False, True))
                print(f"| {shape} | {'fp8' if fp8 else 'bf16'} | {step} | {len(ctx)} | "
                      f"{a:6.1f} ({nb / a / 1e3:4.0f}) | {o:6.1f} ({nb / o / 1e3:4.0f}) | "
                      f"{a / o - 1:+.1%} |", flush=True)
                torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--no-workload", action="store_true", help="skip the workload's batches")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}: one layer's paged attention, context "
          f"{args.context}, bf16 queries; GPU us per call")
    print("| shape | batch | bf16 pool us | GB/s | fp8 pool us | GB/s | speedup |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape in args.shapes:
        for num_seqs, q_len in ((1, 1), (64, 1), (256, 1), (8, 512)):
            (bf, nb), (f8, n8) = (bench(shape, [args.context] * num_seqs, q_len, fp8)
                                  for fp8 in (False, True))
            label = f"{num_seqs} decodes" if q_len == 1 else f"{num_seqs} x {q_len}-token chunks"
            print(f"| {shape} | {label} | {bf:8.1f} | {nb / bf / 1e3:5.0f} | {f8:8.1f} | "
                  f"{n8 / f8 / 1e3:5.0f} | {bf / f8:4.2f}x |", flush=True)
    if not args.no_workload:
        workload_table(args.shapes)


if __name__ == "__main__":
    main()
