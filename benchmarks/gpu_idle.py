"""GPU idle time between decode steps, from a torch.profiler trace of steady decoding.

Fills `--batch` sequences with 512-token prompts, runs until all of them decode, then profiles
`--steps` decode steps: busy = the union of the GPU kernels' intervals, idle = the rest of the
window from the first kernel's start to the last kernel's end.

With --top, the kernels that add most to a step: walking the kernels in start order, the part
of each past the latest end so far (under programmatic dependent launch a kernel's own duration
includes its wait for the one before, so durations overstate the small kernels).

The profiler slows the host: under it a CUDA graph launch costs the host 300-670 µs against
25-28 µs without (H200, 2026-12-01), so where the host is the limit the window's idle time is
overstated. So the same number of steps is first timed without the profiler, and the idle
share reported against that: 1 - (GPU busy a step, from the profile) / (wall time a step, not
profiled). The kernels' own intervals are what the profiler measures well.

    python scripts/gpu_idle.py --shape qwen3-0.6b --random-weights --batch 256
    python scripts/gpu_idle.py --shape llama3.1-8b --random-weights --quantization fp8 \
        --kv-cache-dtype fp8 --top 15
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.models import add_model_args, model_path, quant_args


def critical_times(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """What each kernel adds to the GPU's busy time, summed by name: walking the (name, start,
    end) spans in start order, the part of each past the latest end so far. Under PDL a kernel
    starts before the one before it ends and waits in its programs, so its duration overstates
    what it costs the step; this does not. The values sum to the union of the spans."""
    added: dict[str, float] = {}
    end = float("-inf")
    for name, s, e in sorted(spans, key=lambda span: span[1]):
        added[name] = added.get(name, 0.0) + max(0.0, e - max(s, end))
        end = max(end, e)
    return added


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    ap.add_argument("--top", type=int, default=0, help="also list the N costliest kernels")
    args = ap.parse_args()
    path = model_path(args, ap)

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from conveyor import LLM, SamplingParams
    from conveyor.shared.messages.engine import AddRequest

    llm = LLM(model=path, device=args.device, skip_tokenizer_init=True, max_num_seqs=args.batch,
              max_model_len=2048, max_num_batched_tokens=8192,
              async_scheduling=args.async_scheduling, load_format=args.load_format,
              **quant_args(args))
    core = llm.engine
    params = SamplingParams(temperature=0.6, max_tokens=1000, ignore_eos=True)
    vocab = min(10000, core.model_config.vocab_size)
    for i in range(args.batch):
        core.add(AddRequest(id=f"{i}/0", token_ids=[(i * 7 + j) % vocab for j in range(512)],
                            sampling=params))
    while core.scheduler.num_waiting or any(r.num_computed_tokens < r.prompt_len
                                            for r in core.scheduler.running):
        core.step()
    for _ in range(5):
        core.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda"
                                           else [])
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    sync()
    plain = (time.perf_counter() - t0) / args.steps
    print(f"batch {args.batch}, async scheduling {'on' if args.async_scheduling else 'off'}: "
          f"{plain * 1e3:.2f} ms per decode step")
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        sync()
        wall = time.perf_counter() - t0
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events]
    if not kernels:
        print("no GPU kernels in the trace")
        return
    window = max(e for *_, e in kernels) - min(s for _, s, _ in kernels)  # microseconds
    added = critical_times(kernels)
    busy = sum(added.values())
    per_step = busy / args.steps / 1e6                                      # seconds
    print(f"GPU busy {per_step * 1e3:.2f} ms per step: idle {max(0.0, 1 - per_step / plain):.1%} "
          f"of a step not profiled")
    print(f"under the profiler: {wall / args.steps * 1e3:.2f} ms per step, idle "
          f"{(window - busy) / window:.1%} of the {window / 1e3:.1f} ms window "
          f"({len(kernels)} kernels)")
    if args.top:
        print_top(events, added, args.steps, args.top)


def print_top(events: list, added: dict[str, float], steps: int, top: int) -> None:
    """The kernels that add most to the GPU's busy time, per decode step (critical_times), with
    their own durations beside (under PDL those include the wait for the kernel before)."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in events:
        total[e.name] = total.get(e.name, 0.0) + e.time_range.elapsed_us()
        count[e.name] = count.get(e.name, 0) + 1
    print(f"{'adds us':>9} {'lasts us':>9} {'calls':>6}  kernel (per step)")
    for name in sorted(added, key=added.get, reverse=True)[:top]:
        print(f"{added[name] / steps:9.1f} {total[name] / steps:9.1f} "
              f"{count[name] / steps:6.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
