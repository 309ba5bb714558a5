"""Tile sweep of the fused-MoE kernels (kernels/fused_moe.py) on CUDA, against the bytes bound.

One MoE layer of a published shape (Qwen3-30B-A3B by default: 128 experts, top 8, hidden 2048,
expert intermediate 768; Mixtral-8x7B: 8 experts, top 2, 4096, 14336), bf16, routed by random
logits, at several token counts T. Each cell is the GPU time of the whole `fused_moe` call
(align, the two grouped GEMMs, SiLU-and-mul, the per-token sum) with one tile choice
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), CALLS calls in a CUDA graph, median of REPS replays;
TB/s counts the weights of the experts the tokens picked, read once (one layer's experts are
1.2 GB, far past the L2, so every call reads HBM). The row's last cells: the fastest tile and the
engine's choice (`fused_moe._tiles`). The bound is those bytes at the H200's ~4.3 TB/s copy rate.

    python scripts/bench_moe_tiles.py [--shape qwen3-30b-a3b] [--tokens 1 16 64 256 1024 4096]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from conveyor.kernels.fused_moe import _tiles, fused_moe, route

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TILES = [(16, 64, 64, 4, 4), (16, 64, 128, 4, 3), (16, 64, 256, 4, 2), (16, 128, 128, 4, 2),
         (32, 64, 128, 4, 3), (32, 128, 128, 4, 2), (32, 256, 128, 4, 2), (64, 64, 128, 4, 3),
         (64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3), (128, 128, 64, 4, 3),
         (128, 128, 64, 8, 4), (128, 256, 64, 8, 4)]
CALLS = 20
REPS = 5


def graph_us(fn) -> float:
    """Median GPU microseconds a call of fn, CALLS calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    del graph
    return statistics.median(times)


def moe_us(x, w13, w2, weights, ids, tiles) -> float:
    return graph_us(lambda: fused_moe(x, w13, w2, weights, ids, tiles))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    experts, top_k, hidden, inter = SHAPES[args.shape]
    torch.manual_seed(0)
    dt = torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dt) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=dt) / inter ** 0.5
    expert_bytes = 3 * hidden * inter * 2
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
        print(f"| {t} | {nbytes // expert_bytes} | {nbytes / 4.3e6:.0f} | {' | '.join(cells)} | "
              f"{best} {times[best]:.0f} | {engine} {times[engine]:.0f} |", flush=True)
