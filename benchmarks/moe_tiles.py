"""Tile sweep of the fused-MoE kernels (kernels/fused_moe.py) on CUDA, against the bytes bound.

One MoE layer of a published shape (Qwen3-30B-A3B by default: 128 experts, top 8, hidden 2048,
expert intermediate 768; Mixtral-8x7B: 8 experts, top 2, 4096, 14336), bf16, routed by random
logits, at several token counts T. Each cell is the GPU time of the whole `fused_moe` call
(align, the two grouped GEMMs, SiLU-and-mul, the per-token sum) with one tile choice
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), CALLS calls in a CUDA graph, median of its replays;
TB/s counts the weights of the experts the tokens picked, read once (one layer's experts are
1.2 GB, far past the L2, so every call reads HBM). The row's last cells: the fastest tile and the
engine's choice (`fused_moe._tiles`). The bound is those bytes at the H200's 4.28 TB/s copy rate.

--parts times the call's parts on the engine's tiles instead, each in a graph of its own: align
(sorting the pairs by expert), the gate-up GEMM, SiLU-and-mul, the down GEMM, the per-token sum.

    python scripts/bench_moe_tiles.py [--shape qwen3-30b-a3b] [--tokens 1 16 64 256 1024 4096]
    python scripts/bench_moe_tiles.py --parts [--tokens 16 256]

--bound prints the reference workload's bandwidth bound for the shape (no GPU needed): its
decode steps in order, the requests still generating at step s being those whose max_tokens
reach s (all of them start together: 256 fit the engine's max_num_seqs); a step reads the
experts its tokens pick (E * (1 - (1 - K/E)^batch) a layer, for uniform routing), the other
weights (attention, norms, router, the LM head) and the live sequences' KV cache. Prefill is
left out, which only raises the bound.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.kernel_timings import graph_us
from conveyor.kernels import fused_moe as moe
from conveyor.kernels.fused_moe import _tiles, fused_moe
from conveyor.kernels.silu_and_mul import silu_and_mul
from conveyor.worker.layers.router import route

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
# per shape: layers, bf16 bytes a step of the weights besides the experts (attention, router, LM
# head; the embedding reads a row a token), KV bytes a token
OTHER = {"qwen3-30b-a3b": (48, 2 * (48 * 2048 * (4096 + 2 * 512 + 4096 + 128) + 151936 * 2048),
                           48 * 4 * 128 * 2 * 2),
         "mixtral-8x7b": (32, 2 * (32 * 4096 * (4096 + 2 * 1024 + 4096 + 8) + 32000 * 4096),
                          32 * 8 * 128 * 2 * 2)}
COPY_TBS, PEAK_TBS = 4.28, 4.8     # the H200's measured device-to-device copy rate; its peak
TILES = [(16, 64, 64, 4, 4), (16, 64, 128, 4, 3), (16, 64, 256, 4, 2), (16, 128, 128, 4, 2),
         (32, 64, 128, 4, 3), (32, 128, 128, 4, 2), (32, 256, 128, 4, 2), (64, 64, 128, 4, 3),
         (64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3), (128, 128, 64, 4, 3),
         (128, 128, 64, 8, 4), (128, 256, 64, 8, 4)]
CALLS = 20


def call_us(fn) -> float:
    """Median GPU us a call of fn, CALLS calls in one CUDA graph (kernel_timings.graph_us)."""
    return graph_us([fn] * CALLS)


def moe_us(x, w13, w2, weights, ids, tiles) -> float:
    return call_us(lambda: fused_moe(x, w13, w2, weights, ids, tiles))


def parts_us(x, w13, w2, weights, ids) -> dict[str, float]:
    """GPU us of each part of fused_moe on the engine's tiles (the module's own functions)."""
    (t, h), (e, two_i, _) = x.shape, w13.shape
    top_k = ids.shape[1]
    pairs = t * top_k
    tiles = _tiles(pairs, e)
    sorted_ids, expert_ids, total = moe.align(ids, e, tiles[0])
    flat = weights.reshape(-1).contiguous()
    gate_up = torch.empty((pairs, two_i), dtype=x.dtype, device=x.device)
    act = silu_and_mul(gate_up)
    down = torch.empty((pairs, h), dtype=x.dtype, device=x.device)
    return {
        "align": call_us(lambda: moe.align(ids, e, tiles[0])),
        # (no scales, zero points or biases: bf16 experts)
        "gate-up": call_us(lambda: moe._gemm(x, w13, None, None, None, gate_up, flat, sorted_ids,
                                             expert_ids, total, pairs, top_k, False, tiles)),
        "silu": call_us(lambda: silu_and_mul(gate_up)),
        "down": call_us(lambda: moe._gemm(act, w2, None, None, None, down, flat, sorted_ids,
                                          expert_ids, total, pairs, 1, True, tiles)),
        "sum": call_us(lambda: down.view(t, top_k, h).sum(dim=1, dtype=torch.float32)
                       .to(x.dtype)),
        "whole": moe_us(x, w13, w2, weights, ids, tiles),
    }


def workload_bound(shape: str) -> None:
    from benchmarks.reference_workload import workload

    experts, top_k, hidden, inter = SHAPES[shape]
    layers, other, kv_token = OTHER[shape]
    prompts, max_tokens = workload()[:2]
    lens = [len(p) for p in prompts]
    expert = kv = dense = 0.0
    for s in range(1, max(max_tokens) + 1):
        live = [i for i, m in enumerate(max_tokens) if m >= s]
        picked = experts * (1 - (1 - top_k / experts) ** len(live))
        expert += layers * picked * 3 * hidden * inter * 2
        kv += sum(lens[i] + s for i in live) * kv_token
        dense += other
    total = expert + kv + dense
    out = sum(max_tokens)
    print(f"{shape}, the reference workload's {max(max_tokens)} decode steps, {out} tokens: "
          f"experts {expert / 1e12:.1f} TB, KV {kv / 1e12:.1f} TB, other weights "
          f"{dense / 1e12:.1f} TB; {total / 1e12:.1f} TB")
    for name, rate in (("copy rate", COPY_TBS), ("peak", PEAK_TBS)):
        seconds = total / (rate * 1e12)
        print(f"  at the {name} {rate} TB/s: {seconds:.1f} s, {out / seconds:,.0f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    ap.add_argument("--parts", action="store_true", help="time the parts on the engine's tiles")
    ap.add_argument("--bound", action="store_true", help="the reference workload's bound")
    args = ap.parse_args()
    if args.bound:
        return workload_bound(args.shape)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    experts, top_k, hidden, inter = SHAPES[args.shape]
    torch.manual_seed(0)
    dt = torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dt) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=dt) / inter ** 0.5
    expert_bytes = 3 * hidden * inter * 2
    if args.parts:
        print(f"{torch.cuda.get_device_name()}, {args.shape}: us a call of each part")
        for t in args.tokens:
            x = torch.randn(t, hidden, device="cuda", dtype=dt)
            weights, ids = route(torch.randn(t, experts, device="cuda"), top_k, True, dt)
            parts = parts_us(x, w13, w2, weights, ids)
            print(f"T {t}, tiles {_tiles(t * top_k, experts)}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
        return
    print(f"{torch.cuda.get_device_name()}, {args.shape}: {experts} experts, top {top_k}, "
          f"hidden {hidden}, intermediate {inter}; us a call (TB/s of the picked experts' weights)")
    print("| T | experts picked | bound us | " + " | ".join(map(str, TILES))
          + " | fastest | engine's |")
    print("|---:|---:|---:|" + "---:|" * (len(TILES) + 2))
    for t in args.tokens:
        x = torch.randn(t, hidden, device="cuda", dtype=dt)
        weights, ids = route(torch.randn(t, experts, device="cuda"), top_k, True, dt)
        nbytes = ids.unique().numel() * expert_bytes
        times = {tiles: moe_us(x, w13, w2, weights, ids, tiles) for tiles in TILES}
        engine = _tiles(t * top_k, experts)
        if engine not in times:
            times[engine] = moe_us(x, w13, w2, weights, ids, engine)
        best = min(times, key=times.get)
        cells = [f"{times[k]:.0f} ({nbytes / times[k] / 1e6:.2f})" for k in TILES]
        print(f"| {t} | {nbytes // expert_bytes} | {nbytes / COPY_TBS / 1e6:.0f} | "
              f"{' | '.join(cells)} | {best} {times[best]:.0f} | {engine} {times[engine]:.0f} |",
              flush=True)
