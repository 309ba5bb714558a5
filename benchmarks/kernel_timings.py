"""Microbenchmark of the decode kernels against what they replace, on CUDA.

GEMMs: the skinny GEMM against F.linear (cuBLAS) on the Qwen3-0.6B and Llama-3.1-8B decode
shapes at M = 1 (single-stream decode); the down projection also with SiLU-and-mul fused against the
silu_and_mul kernel followed by F.linear. Sampling: the fused kernel against the torch math it
replaces (float32 copy, exponential_, log_, addcmul, argmax), at N = 1 and 256 x 151,936; and
top-p rows by the rejection kernel against the torch path's softmax, full sort and race.

Each figure is GPU time per call: CALLS calls captured in one CUDA graph (as decode runs), each
on its own copy of the weights or logits so that they come from HBM as in a model, not from the
L2 (60 MB on an H200); median of REPS replays. GB/s counts the weight (or logits) bytes read once.
The last lines add up one decode step's GEMMs (per layer qkv, o, gate_up, silu+down; LM head).

Weight-quantized GEMMs (--tables quant): the same shapes at M = 1, 16, 64, 256 and 4,096 through
linear(), as the model runs them, with bf16, int8 (W8A16: the skinny GEMV at M = 1, the Triton
GEMM, from 1,024 rows dequantize + cuBLAS) and fp8 (the skinny GEMV over fp8 weights at M = 1,
per-token quantization + _scaled_mm above) and 4-bit (W4A16, group 128: the CUDA-core GEMV at
M = 1, the tiled Triton kernel up to 64 rows, dequantize + cuBLAS above) weights; where
linear() dequantizes, also the 4-bit tiled kernel on its own, and from 256 rows both int8
prefill choices (to check the two modules' CUBLAS_FROM_M). GB/s counts the weight's bytes as
stored. Its last lines add up a decode step's GEMMs with the LM head kept in bf16 (the default
--keep-precision).

The read ceiling (--tables read): how long a plain read of each weight's bytes takes (bf16 and
1-byte), by a kernel that only XORs them (8 KB a program, one load a thread, one 4-byte store a
program). The GEMV's time over this one's, for the same bytes, is how far the GEMV is from the
device's ceiling at that size; small reads do not reach the peak (ramp-up and tail).

fp8 at decode batch sizes (--tables fp8): fp8_gemm (its Triton tiles) against torch._scaled_mm
(cuBLAS, plain and with use_fast_accum) at M = 16 to 256, and the per-token quantization fused
into RMSNorm / SiLU-and-mul against the separate kernels.

    python scripts/bench_kernels.py [--tables base quant read fp8] [--shapes llama3.1-8b]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from conveyor.kernels import w4a16_gemm as w4a16
from conveyor.kernels._triton import jit, tl
from conveyor.kernels._util import Fp8Rows, num_sms
from conveyor.kernels.dequantize import dequantize
from conveyor.kernels.fp8_gemm import TILED_TO_M, fp8_gemm, tiling
from conveyor.kernels.int8_gemm import int8_gemm
from conveyor.kernels.quant_fp8 import quant_fp8
from conveyor.kernels.rms_norm import rms_norm
from conveyor.kernels.sample import sample
from conveyor.kernels.sample_nucleus import sample_nucleus
from conveyor.kernels.silu_and_mul import silu_and_mul
from conveyor.kernels.skinny_gemm import skinny_gemm
from conveyor.kernels.w4a16_gemm import pack_int4
from conveyor.worker.layers.linear import linear
from conveyor.worker.layers.quantization import quantize_weight

# (N, K) of each weight: [out_features, in_features]
SHAPES = {
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                   "down": (1024, 3072), "lm_head": (151936, 1024)},
    "llama3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                    "down": (4096, 14336), "lm_head": (128256, 4096)},
}
LAYERS = {"qwen3-0.6b": 28, "llama3.1-8b": 32}
VOCAB = 151936
CALLS = 100
REPS = 7


def graph_us(calls: list) -> float:
    """Median GPU microseconds per call of `calls`, captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):            # warm-up: compiles, allocates, tunes nothing
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def copies(nbytes: int) -> int:
    """How many copies of an operand of nbytes make a working set of 4x the L2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    return max(1, min(CALLS, -(-4 * l2 // nbytes)))


def cycled(items: list) -> list:
    """CALLS operands taken from items in turn (the copies made by `copies`)."""
    return [items[i % len(items)] for i in range(CALLS)]


def bench_gemm(n: int, k: int, m: int, fused_silu: bool) -> tuple[float, float, int]:
    """(skinny us, torch us, weight bytes) for [m, k] x [n, k]^T (x [m, 2k] with fused_silu)."""
    dt = torch.bfloat16
    weights = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
               for _ in range(copies(n * k * 2))]
    x = torch.randn(m, 2 * k if fused_silu else k, device="cuda", dtype=dt)
    pick = cycled(weights)
    if fused_silu:
        ours = [lambda w=w: skinny_gemm(x, w, silu_mul=True) for w in pick]
        theirs = [lambda w=w: F.linear(silu_and_mul(x), w) for w in pick]
    else:
        ours = [lambda w=w: skinny_gemm(x, w) for w in pick]
        theirs = [lambda w=w: F.linear(x, w) for w in pick]
    return graph_us(ours), graph_us(theirs), n * k * 2


QUANT_M = (1, 16, 64, 256, 4096)
LAYER = ("qkv", "o", "gate_up", "silu+down")


def bench_quant(n: int, k: int, m: int, fused_silu: bool) -> dict[str, float]:
    """GPU us per call of linear() with bf16, int8 and fp8 weights (from 256 rows also of the
    int8 Triton GEMM and of dequantize + F.linear), x [m, k] (x [m, 2k] with fused_silu) and a
    weight [n, k]."""
    dt = torch.bfloat16
    base = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
    x = torch.randn(m, 2 * k if fused_silu else k, device="cuda", dtype=dt)
    variants = {"bf16": (base, None, None)}
    for mode in ("int8", "fp8"):
        variants[mode] = (*quantize_weight(base, mode), None)
    groups = k // 128                       # int4: random words, groups of 128, zero point 8
    variants["int4"] = (pack_int4(torch.randint(0, 16, (n, k), device="cuda")),
                        torch.full((n, groups), 1e-3, device="cuda"),
                        torch.full((n, groups), 8.0, device="cuda"))
    out = {}
    for name, (w, scale, zero) in variants.items():
        ws = [(w.clone(), scale) for _ in range(copies(w.numel() * w.element_size()))]
        pick = cycled(ws)
        out[name] = graph_us([lambda w=w, s=s, z=zero: linear(x, w, silu_mul=fused_silu,
                                                              scale=s, zero=z)
                              for w, s in pick])
        if name == "int4" and m >= w4a16.CUBLAS_FROM_M:   # the tensor-core tiles instead
            a = silu_and_mul(x) if fused_silu else x
            out["int4 tiles"] = graph_us([lambda w=w, s=s, a=a, z=zero: _int4_tiles(a, w, s, z)
                                          for w, s in pick])
        if name == "int8" and m >= 256:   # both prefill choices, whichever linear() takes
            a = silu_and_mul(x) if fused_silu else x    # (their times leave the SiLU out)
            out["int8 Triton"] = graph_us([lambda w=w, s=s, a=a: int8_gemm(a, w, s)
                                           for w, s in pick])
            out["int8 deq+cuBLAS"] = graph_us([
                lambda w=w, s=s, a=a: F.linear(a, dequantize(w, s, dt)) for w, s in pick])
    return out


def _int4_tiles(x, words, scale, zero):
    """w4a16_gemm through its tensor-core tiles at any M (linear() dequantizes from
    CUBLAS_FROM_M rows)."""
    saved, w4a16.CUBLAS_FROM_M = w4a16.CUBLAS_FROM_M, 1 << 30
    try:
        return w4a16.w4a16_gemm(x, words, scale, zero)
    finally:
        w4a16.CUBLAS_FROM_M = saved


def _cell(times: dict[str, float], variant: str, nbytes: int) -> str:
    if variant not in times:
        return "-"
    return f"{times[variant]:8.1f} ({nbytes / times[variant] / 1e3:5.0f})"


def quant_table(shapes: list[str]) -> None:
    print("\nWeight-quantized GEMMs through linear(): GPU us per call (GB/s of the stored "
          "weight); speed-up over bf16")
    print("| GEMM | M | bf16 us | int8 us | fp8 us | int4 us | int4 tiles us | int8 Triton us | "
          "int8 deq+cuBLAS us | int8 x | fp8 x | int4 x |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    decode = []
    for shape in shapes:
        for m in QUANT_M:
            step = {}
            for name, (n, k) in SHAPES[shape].items():
                for label, fused in [(name, False)] + ([("silu+down", True)]
                                                       if name == "down" else []):
                    if name == "lm_head" and m > 1:
                        continue
                    t = step[label] = bench_quant(n, k, m, fused)
                    size = {"bf16": 2, "int4": 0.5, "int4 tiles": 0.5}
                    cells = [_cell(t, v, n * k * size.get(v, 1))
                             for v in ("bf16", "int8", "fp8", "int4", "int4 tiles",
                                       "int8 Triton", "int8 deq+cuBLAS")]
                    print(f"| {shape} {label} [{n}x{k}] | {m} | {' | '.join(cells)} | "
                          f"{t['bf16'] / t['int8']:.2f} | {t['bf16'] / t['fp8']:.2f} | "
                          f"{t['bf16'] / t['int4']:.2f} |", flush=True)
            if m == 1:
                head = step["lm_head"]["bf16"]          # kept in bf16 by default
                decode.append((shape, {v: LAYERS[shape] * sum(step[g][v] for g in LAYER) + head
                                       for v in ("bf16", "int8", "fp8", "int4")}))
    print("\nGEMMs of one single-stream decode step (layers x (qkv, o, gate_up, silu+down) + "
          "bf16 lm_head):")
    for shape, t in decode:
        print(f"  {shape} M=1: bf16 {t['bf16'] / 1e3:.3f} ms, int8 {t['int8'] / 1e3:.3f} ms "
              f"({t['bf16'] / t['int8']:.2f}x), fp8 {t['fp8'] / 1e3:.3f} ms "
              f"({t['bf16'] / t['fp8']:.2f}x), int4 {t['int4'] / 1e3:.3f} ms "
              f"({t['bf16'] / t['int4']:.2f}x)")


FP8_M = (16, 64, 128, 192, 256)


def _fp8_ways(x: torch.Tensor, sx: torch.Tensor, pick: list) -> list[float]:
    """GPU us of x [m, k] fp8 times each (w [n, k] fp8, s [n, 1]) of pick: fp8_gemm (the Triton
    tiles up to TILED_TO_M rows on Hopper), torch._scaled_mm as it was called before them, and
    with use_fast_accum."""
    mm, bf = torch._scaled_mm, torch.bfloat16
    rows = Fp8Rows(x, sx, bf)
    return [
        graph_us([lambda w=w, s=s: fp8_gemm(rows, w, s) for w, s in pick]),
        graph_us([lambda w=w, s=s: mm(x, w.t(), scale_a=sx, scale_b=s.view(1, -1), out_dtype=bf)
                  for w, s in pick]),
        graph_us([lambda w=w, s=s: mm(x, w.t(), scale_a=sx, scale_b=s.view(1, -1), out_dtype=bf,
                                      use_fast_accum=True) for w, s in pick])]


READ_BLOCK = 2048      # int32s a program reads: 8 KB, the best of 8-256 KB a program on an H200


@jit
def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """out[program] = XOR of the program's BLOCK int32s: a stream of reads, no arithmetic."""
    pid = tl.program_id(0)
    x = tl.load(x_ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid, tl.xor_sum(x, 0))


def read(x: torch.Tensor) -> torch.Tensor:
    """The per-program XORs of int32 x (numel a multiple of READ_BLOCK), new."""
    out = torch.empty(x.numel() // READ_BLOCK, dtype=torch.int32, device=x.device)
    _read_kernel[(out.numel(),)](x, out, BLOCK=READ_BLOCK, num_warps=4)
    return out


def read_us(nbytes: int) -> float:
    """GPU us per plain read of nbytes (rounded down to whole programs), as graph_us times."""
    n = nbytes // 4 // READ_BLOCK * READ_BLOCK
    bufs = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
            for _ in range(copies(n * 4))]
    pick = cycled(bufs)
    return graph_us([lambda b=b: read(b) for b in pick])


def read_table(shapes: list[str]) -> None:
    print("\nThe read ceiling: GPU us to read each weight's bytes and nothing else (TB/s)")
    print("| weight | bf16 bytes: read us | 1-byte: read us |")
    print("|---|---:|---:|")
    for shape in shapes:
        for name, (n, k) in SHAPES[shape].items():
            cells = []
            for wb in (2, 1):
                t = read_us(n * k * wb)
                cells.append(f"{t:8.1f} ({n * k * wb / t / 1e6:4.2f})")
            print(f"| {shape} {name} [{n}x{k}] | {' | '.join(cells)} |", flush=True)


def fp8_table(shapes: list[str]) -> None:
    sms = num_sms(torch.device("cuda", 0))
    print("\nfp8 GEMMs at decode batch sizes: GPU us per call, TFLOP/s and GB/s of fp8_gemm")
    print("| GEMM | M | fp8_gemm | cuBLAS | cuBLAS use_fast_accum | fp8_gemm x | tile | TFLOP/s "
          "| GB/s |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for shape in shapes:
        layer = {n: nk for n, nk in SHAPES[shape].items() if n != "lm_head"}
        weights = {}
        for name, (n, k) in layer.items():
            weights[name] = [quantize_weight(torch.randn(n, k, device="cuda") / k ** 0.5, "fp8")
                             for _ in range(copies(n * k))]
        for m in FP8_M:
            total = [0.0] * 3
            for name, (n, k) in layer.items():
                x, sx = quant_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
                t = _fp8_ways(x, sx, cycled(weights[name]))
                total = [a + b for a, b in zip(total, t)]
                tile = "x".join(map(str, tiling(m, n, sms)[:2])) if m <= TILED_TO_M else "cuBLAS"
                print(f"| {shape} {name} [{n}x{k}] | {m} | "
                      + " | ".join(f"{v:.1f}" for v in t)
                      + f" | {t[1] / t[0]:.2f} | {tile} | {2 * m * n * k / t[0] / 1e6:.0f} | "
                      f"{n * k / t[0] / 1e3:.0f} |", flush=True)
            print(f"| {shape} one layer | {m} | " + " | ".join(f"{v:.1f}" for v in total)
                  + f" | {total[1] / total[0]:.2f} | | | |")
        del weights
    print("\nPer-token fp8 quantization of an fp8 layer's input: GPU us per call")
    print("| input | M | fused | separate kernels |")
    print("|---|---:|---:|---:|")
    for shape in shapes:
        hidden, inter = SHAPES[shape]["o"][0], SHAPES[shape]["down"][1]
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        for m in FP8_M:
            xs = [torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
                  for _ in range(copies(m * hidden * 4))]
            pairs = [(xs[i % len(xs)], xs[(i + 1) % len(xs)]) for i in range(CALLS)]
            fused = graph_us([lambda x=x, r=r, w=w: rms_norm(x, w, 1e-5, r, fp8=True)
                              for x, r in pairs])
            apart = graph_us([lambda x=x, r=r, w=w: quant_fp8(rms_norm(x, w, 1e-5, r)[0])
                              for x, r in pairs])
            print(f"| {shape} RMSNorm + residual [{hidden}] | {m} | {fused:.1f} | {apart:.1f} |")
            gs = [torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
                  for _ in range(copies(m * inter * 4))]
            pick = cycled(gs)
            fused = graph_us([lambda g=g: quant_fp8(g, silu_mul=True) for g in pick])
            apart = graph_us([lambda g=g: quant_fp8(silu_and_mul(g)) for g in pick])
            print(f"| {shape} SiLU-and-mul [2x{inter}] | {m} | {fused:.1f} | {apart:.1f} |",
                  flush=True)


def torch_sample(x: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """The torch sampler's math for greedy or temperature-only rows (before the fused kernel:
    the model's logits upcast, then an exponential race)."""
    x = x.float()
    if temperature is None:
        return x.argmax(-1)
    noise = torch.empty_like(x).exponential_()
    noise.log_()
    return torch.addcmul(x, temperature[:, None], noise, value=-1).argmax(-1)


def bench_sample(n: int, greedy: bool) -> tuple[float, float, int]:
    logits = [torch.randn(n, VOCAB, device="cuda").to(torch.bfloat16)
              for _ in range(copies(n * VOCAB * 2))]
    pick = cycled(logits)
    temperature = None if greedy else torch.full((n,), 0.6, device="cuda")
    seeds = None if greedy else torch.arange(n, device="cuda")
    ours = [lambda x=x: sample(x, temperature, seeds) for x in pick]
    theirs = [lambda x=x: torch_sample(x, temperature) for x in pick]
    return graph_us(ours), graph_us(theirs), n * VOCAB * 2


def bench_top_p(n: int, top_p: float = 0.9) -> tuple[float, float, int]:
    """Top-p rows: the rejection kernel against the sampler's torch path (softmax, full sort,
    cumsum, scatter back, then the exponential race)."""
    logits = [torch.randn(n, VOCAB, device="cuda").to(torch.bfloat16)
              for _ in range(copies(n * VOCAB * 2))]
    pick = cycled(logits)
    rows = torch.arange(n, device="cuda")
    t, p, none = (torch.full((n,), v, device="cuda") for v in (0.6, top_p, 0.0))
    seeds = torch.arange(n, device="cuda")

    def torch_path(x):      # the sampler's _top_p, with its p already on the device
        x = x.float() / t[:, None]
        sorted_probs, order = x.softmax(-1).sort(-1, descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p[:, None]
        x = x.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))
        return (x - torch.empty_like(x).exponential_().log_()).argmax(-1)

    ours = [lambda x=x: sample_nucleus(x, rows, t, p, none, seeds) for x in pick]
    theirs = [lambda x=x: torch_path(x) for x in pick]
    return graph_us(ours), graph_us(theirs), n * VOCAB * 2


def row(name: str, ours: float, theirs: float, nbytes: int) -> str:
    return (f"| {name} | {ours:8.1f} | {nbytes / ours / 1e3:6.0f} | {theirs:8.1f} | "
            f"{nbytes / theirs / 1e3:6.0f} | {theirs / ours:5.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tables", nargs="+", default=["base", "quant"],
                    choices=["base", "quant", "read", "fp8"],
                    help="base: skinny GEMM and sampling against torch; quant: int8/fp8 weights; "
                         "read: a plain read of the weights' bytes; fp8: the fp8 GEMMs and the "
                         "fused quantization at decode batches")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU us per call, "
          f"{CALLS} calls per CUDA graph, median of {REPS}")
    if "base" in args.tables:
        base_table(args.shapes)
    if "quant" in args.tables:
        quant_table(args.shapes)
    if "read" in args.tables:
        read_table(args.shapes)
    if "fp8" in args.tables:
        fp8_table(args.shapes)


def base_table(shapes: list[str]) -> None:
    print("| kernel | ours us | GB/s | torch us | GB/s | speedup |")
    print("|---|---:|---:|---:|---:|---:|")
    totals = []
    for shape in shapes:
        for m in (1,):                      # the skinny GEMM takes one row (decode at batch 1)
            step = {}                       # label -> (ours us, torch us)
            for name, (n, k) in SHAPES[shape].items():
                variants = [(name, False)]
                if name == "down":
                    variants.append(("silu+down", True))
                for label, fused in variants:
                    ours, theirs, nbytes = bench_gemm(n, k, m, fused)
                    print(row(f"{shape} {label} [{n}x{k}] M={m}", ours, theirs, nbytes),
                          flush=True)
                    step[label] = (ours, theirs)
            layer = ("qkv", "o", "gate_up", "silu+down")
            ours = LAYERS[shape] * sum(step[name][0] for name in layer) + step["lm_head"][0]
            theirs = LAYERS[shape] * sum(step[name][1] for name in layer) + step["lm_head"][1]
            totals.append((shape, m, ours, theirs))
    for n in (1, 256):
        for greedy in (True, False):
            ours, theirs, nbytes = bench_sample(n, greedy)
            kind = "greedy" if greedy else "temperature 0.6"
            print(row(f"sample {kind} [{n}x{VOCAB}] bf16", ours, theirs, nbytes), flush=True)
        ours, theirs, nbytes = bench_top_p(n)
        print(row(f"sample top-p 0.9, T 0.6 [{n}x{VOCAB}] bf16", ours, theirs, nbytes),
              flush=True)
    print("\nGEMMs of one decode step (layers x (qkv, o, gate_up, silu+down) + lm_head):")
    for shape, m, ours, theirs in totals:
        print(f"  {shape} M={m}: skinny {ours / 1e3:.3f} ms, torch {theirs / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
