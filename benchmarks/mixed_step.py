"""The latency of a mixed step, in process: one new prompt of T tokens arrives while 4 sequences
decode; its time to first token (the mixed step, then the next, as steps are pipelined), median
of 5 arrivals per size, with mixed steps eager (max_cudagraph_capture_size 0) and from CUDA
graphs, side by side; also each engine's decode step with 4 running and its start-up time.

    python scripts/bench_mixed_step.py --shape qwen3-0.6b --sizes 16,64,256,512,1024,2048,4096
    python scripts/bench_mixed_step.py --shape llama3.1-8b --graph-cap 4096

Random weights drawn by the engine (load_format dummy); prompts are fresh random ids, so no
arrival hits the prefix cache; the warm-up uses other lengths.
"""
from __future__ import annotations

import argparse
import gc
import random
import time


def measure(path: str, cap: int | None, sizes: list[int]) -> dict[str, float]:
    import torch

    from conveyor import LLM, SamplingParams
    from conveyor.shared.messages.client import GenerateRequest

    t0 = time.perf_counter()
    llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=max(sizes) + 1024, max_cudagraph_capture_size=cap,
              gpu_memory_utilization=0.6)
    row = {"engine start (s)": time.perf_counter() - t0}
    rnd = random.Random(5)

    def prompt(n):
        return [rnd.randint(10, 10000) for _ in range(n)]

    llm.generate([prompt(n) for n in (3, 6, 12, 30, 100, 300, 600, 1000, 3000)],
                 SamplingParams(max_tokens=4), use_tqdm=False)
    first: dict[str, float] = {}

    def deliver(out):
        if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
            first[out.request_id] = time.perf_counter()

    for i in range(4):
        llm.core.submit(GenerateRequest(id=f"bg{i}", prompt_token_ids=prompt(200), stream=True,
                                        sampling=SamplingParams(max_tokens=1 << 20,
                                                                ignore_eos=True)), deliver)
    for _ in range(30):
        llm._step()
    t0 = time.perf_counter()
    for _ in range(100):
        llm._step()
    row["decode step, 4 running"] = (time.perf_counter() - t0) * 10   # ms a step
    for t in sizes:
        times = []
        for k in range(5):
            rid, t0 = f"new{t}-{k}", time.perf_counter()
            llm.core.submit(GenerateRequest(id=rid, prompt_token_ids=prompt(t - 4), stream=True,
                                            sampling=SamplingParams(max_tokens=1)), deliver)
            while rid not in first:
                llm._step()
            times.append((first[rid] - t0) * 1e3)
            for _ in range(3):
                llm._step()
        row[f"TTFT, {t - 4}-token prompt + 4 decodes"] = sorted(times)[2]
    for rid in list(llm.core.open):
        llm.core.cancel(rid)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    from benchmarks.models import build_random_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--sizes", default="16,64,256,512,1024,2048,4096,8192",
                    help="step sizes in tokens (the prompt is 4 fewer)")
    ap.add_argument("--graph-cap", type=int, default=None,
                    help="max_cudagraph_capture_size of the graph engine (default: its largest "
                         "size)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    path = str(build_random_model(args.shape, weights=False))
    eager = measure(path, 0, sizes)
    graph = measure(path, args.graph_cap or max(sizes), sizes)
    print(f"\n{args.shape}: ms (median of 5)               eager    graph   ratio")
    for name in eager:
        print(f"{name:40s} {eager[name]:8.2f} {graph[name]:8.2f} {eager[name] / graph[name]:6.2f}")


if __name__ == "__main__":
    main()
