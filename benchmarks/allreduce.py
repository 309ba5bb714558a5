"""All-reduce time per decode step: torch.distributed across N processes (NCCL on GPUs, gloo on
CPU) on the tensors tensor parallelism moves in a step.

A decode step at batch B all-reduces the [B, hidden] activation twice per layer (after o_proj and
after down_proj), once more after the embedding, and all-gathers the logits [B, vocab / N] once.
For each batch size this times one all-reduce (eager, and on CUDA also replayed from a CUDA graph,
as decode steps run) and one all-gather, the slowest rank's median, and reports
2 x layers all-reduces per step. Every call is first checked for the right sum. On CUDA it also
times the engine's one-shot all-reduce (kernels/all_reduce.py, set up as the workers do in
conveyor/worker/layers/parallel.py) where the engine takes it, alone and with the RMSNorm after
it fused in, each first checked against NCCL's sum of the same random values; the per-step
figure is then the engine's path (the fused one in a graph: a decode step's all-reduces are all
fused; eager steps use NCCL, where the one-shot kernel launched from Python is slower).

    python scripts/bench_allreduce.py --world-size 8                     # Llama-3.1-70B, NCCL
    python scripts/bench_allreduce.py --backend gloo --world-size 4      # CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn, device: torch.device, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean seconds of one fn() in a run of `iters` calls."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            runs.append((time.perf_counter() - t0) / iters)
    return statistics.median(runs)


def graphed(fn, calls: int):
    """A CUDA graph of `calls` calls of fn, and a function that replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):            # NCCL's first calls on a stream stay out of capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def check_one_shot(x: torch.Tensor, rank: int, world: int) -> None:
    """The one-shot sum (and fused norm) of random values against NCCL's sum (and the norm
    kernel): equal at two ranks (one add either way), within a rounding at more."""
    from conveyor.worker.layers import parallel
    from conveyor.worker.layers.norm import RMSNorm

    torch.manual_seed(rank)
    x.copy_(torch.randn_like(x))
    expected = x.clone()
    dist.all_reduce(expected)
    tol = dict(atol=0, rtol=0) if world == 2 else dict(atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(parallel._one_shot(x), expected, **tol)
    norm = RMSNorm(x.shape[1], 1e-5, x.dtype).to(x.device)
    torch.manual_seed(0)                                 # the same residual on every rank
    residual = torch.randn_like(x)
    got = parallel._one_shot(x, norm.weight, norm.eps, residual)
    want = norm(expected, residual)
    torch.testing.assert_close(got[1], want[1], **tol)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)


def check_sum(x: torch.Tensor, rank: int, world: int, what: str) -> None:
    """x holds rank + 1 everywhere on entry; after the all-reduce, 1 + 2 + ... + world."""
    x.fill_(rank + 1)
    dist.all_reduce(x)
    expected = world * (world + 1) // 2
    if not bool((x == expected).all()):
        raise RuntimeError(f"{what}: all_reduce gave {x.flatten()[:4].tolist()}, not {expected}")


def measure(batch: int, rank: int, args, device: torch.device) -> dict:
    """Seconds per call of this rank at one batch size."""
    world, dtype = args.world_size, getattr(torch, args.dtype)
    x = torch.empty(batch, args.hidden, dtype=dtype, device=device)   # [B, hidden]
    check_sum(x, rank, world, f"batch {batch}")
    # NOTE: zeros keep the sums finite over the timed calls; a reduction's speed does not
    # depend on its values
    x.zero_()
    row = {"batch": batch, "bytes": x.numel() * x.element_size(),
           "allreduce_s": timed(lambda: dist.all_reduce(x), device, args.iters)}
    if device.type == "cuda" and args.graph:
        calls = 2 * args.layers
        replay = graphed(lambda: dist.all_reduce(x), calls)
        row["allreduce_graph_s"] = timed(replay, device, 10) / calls
    from conveyor.worker.layers import parallel

    if parallel._one_shot is not None and parallel._one_shot.fits(x):
        from conveyor.worker.layers.norm import RMSNorm

        check_one_shot(x, rank, world)
        x.zero_()
        norm = RMSNorm(args.hidden, 1e-5, dtype).to(device)
        residual = torch.zeros_like(x)
        calls = 2 * args.layers
        one_shot = parallel._one_shot
        for name, fn in (("one_shot", lambda: one_shot(x)),
                         ("fused", lambda: one_shot(x, norm.weight, norm.eps, residual))):
            row[f"{name}_s"] = timed(fn, device, args.iters)      # eager: the engine's NCCL
            if args.graph:                                          # as decode steps take it
                row[f"{name}_graph_s"] = timed(graphed(fn, calls), device, 10) / calls
    logits = torch.randn(batch, -(-args.vocab // world), dtype=dtype, device=device)
    parts = [torch.empty_like(logits) for _ in range(world)]       # [B, vocab / N] each
    row["allgather_s"] = timed(lambda: dist.all_gather(parts, logits), device, args.iters)
    return row


def rank_main(rank: int, args, rendezvous: str, out_file: str) -> None:
    world = args.world_size
    if args.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(args.backend, init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, device_id=device if device.type == "cuda" else None)
    if device.type == "cuda" and args.custom:
        from conveyor.worker.layers.parallel import enable_custom_all_reduce

        enable_custom_all_reduce(device)
    rows = [measure(batch, rank, args, device) for batch in args.batch]
    for r in rows:                           # the slowest rank's figures
        keys = sorted(k for k in r if k.endswith("_s"))
        t = torch.tensor([r[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        r.update(zip(keys, t.tolist()))
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def report(rows: list[dict], args) -> list[dict]:
    def us(r, key):
        return round(r[key] * 1e6, 2) if key in r else None

    def cell(v):
        return "-" if v is None else f"{v:.1f}"

    results = []
    for r in rows:
        nccl = r.get("allreduce_graph_s", r["allreduce_s"])
        per_call = r.get("fused_graph_s", r.get("fused_s", nccl))     # the engine's path
        res = {"backend": args.backend, "world_size": args.world_size, "dtype": args.dtype,
               "hidden": args.hidden, "layers": args.layers, "batch": r["batch"],
               "allreduce_us": us(r, "allreduce_s"),
               "allreduce_graph_us": us(r, "allreduce_graph_s"),
               "one_shot_us": us(r, "one_shot_s"), "one_shot_graph_us": us(r, "one_shot_graph_s"),
               "fused_us": us(r, "fused_s"), "fused_graph_us": us(r, "fused_graph_s"),
               "allreduce_busbw_gbs": round(r["bytes"] * 2 * (args.world_size - 1)
                                            / args.world_size / nccl / 1e9, 2),
               "allreduce_per_step_ms": round(2 * args.layers * per_call * 1e3, 3),
               "allgather_logits_us": us(r, "allgather_s")}
        results.append(res)
    print(f"{args.backend}, {args.world_size} ranks, [batch, {args.hidden}] {args.dtype}, "
          f"2 x {args.layers} all-reduces per step; us per call (in a CUDA graph)")
    print("| batch | NCCL | NCCL, graph | NCCL bus GB/s | one-shot | one-shot, graph "
          "| one-shot + RMSNorm | + RMSNorm, graph | per step ms | logits all-gather |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        print(f"| {res['batch']} | " + " | ".join(cell(res[k]) for k in (
            "allreduce_us", "allreduce_graph_us", "allreduce_busbw_gbs", "one_shot_us",
            "one_shot_graph_us", "fused_us", "fused_graph_us"))
            + f" | {res['allreduce_per_step_ms']:.3f} | {res['allgather_logits_us']:.1f} |")
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if cuda else "gloo")
    ap.add_argument("--world-size", type=int, default=None,
                    help="processes (default: the GPU count for nccl, 2 for gloo)")
    ap.add_argument("--hidden", type=int, default=8192, help="8192: Llama-3.1-70B")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", default="1,256", help="comma-separated batch sizes")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=200, help="calls per timed run")
    ap.add_argument("--no-graph", dest="graph", action="store_false",
                    help="on CUDA, time eager calls only")
    ap.add_argument("--no-custom", dest="custom", action="store_false",
                    help="on CUDA, NCCL only (leave out the engine's one-shot all-reduce)")
    ap.add_argument("--json", help="append one JSON line per batch size to this file")
    args = ap.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if args.backend == "nccl" else 2
    if args.world_size < 2:
        ap.error("--world-size must be at least 2")
    if args.backend == "nccl" and args.world_size > torch.cuda.device_count():
        ap.error(f"--world-size {args.world_size} needs as many GPUs "
                 f"({torch.cuda.device_count()} here)")
    if min(args.batch) < 1 or args.iters < 1:
        ap.error("--batch sizes and --iters must be at least 1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="conveyor-allreduce-") as tmp:
        out_file = f"{tmp}/result.json"
        mp.spawn(rank_main, args=(args, f"{tmp}/rendezvous", out_file), nprocs=args.world_size)
        rows = json.loads(Path(out_file).read_text())
    results = report(rows, args)
    if args.json:
        with open(args.json, "a") as f:
            for res in results:
                f.write(json.dumps(res) + "\n")
    return results


if __name__ == "__main__":
    main()
