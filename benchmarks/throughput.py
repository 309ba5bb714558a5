"""Offline throughput on the reference workload (issue 4), Nano-vLLM's benchmark:

256 requests, random.seed(0); prompt = random token ids in [0, 10000], lengths uniform in
[100, 1024]; max_tokens uniform in [100, 1024]; ignore_eos; temperature 0.6; a warm-up first.
Reports output tokens / wall time.

The warm-up is more than one call: Triton compiles a kernel variant on its first use (attention's
tile follows the longest query of a step; integer arguments specialise on being divisible by 16),
and a fresh machine has none compiled on disk. So one prompt of each length class is run alone,
then 32 prompts with the lengths of the workload's first 32 for 8 tokens each (mixed steps of
many sizes). The kernels do not specialise on counts that change every step (do_not_specialize),
since each new case (a value of 1, a multiple of 16) would compile a variant inside the timed run:
that cost the Qwen3 run 17-20 % with an empty Triton cache. So with an empty cache it makes 23.7k
and 24.1k tok/s against 24.0k with a filled one (H200, docs/BENCHMARKS.md).

NOTE: the warm-up never runs a timed prompt (reference_workload.warm_up). Its prompts have the
timed ones' lengths but token ids of their own (reference_workload.salted), so the timed pass
finds none of its prompts in the prefix cache.

    python scripts/bench_throughput.py --shape qwen3-0.6b --random-weights [--compare-hf]
    python scripts/bench_throughput.py --shape llama3.1-8b --random-weights --kv-cache-dtype fp8
    python scripts/bench_throughput.py --shape qwen3-30b-a3b --random-weights --fp8-blocks
    python scripts/bench_throughput.py --model /path/to/hf/folder
    python scripts/bench_throughput.py --shape llama3.1-70b --random-weights --tp 8

With --tp the engine runs in `conveyor serve --tp N` (one worker per GPU; the offline LLM runs
one) and the 256 requests go to it at once through the asyncio ZMQ client.
"""
from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks import reference_workload
from benchmarks.models import (
    add_model_args,
    append_json,
    engine_flags,
    model_path,
    quant_args,
    served,
)
from benchmarks.reference_workload import workload


def warm_up(prompts) -> list[list[list[int]]]:
    """The warm-up's calls (reference_workload.warm_up): no timed prompt among them."""
    return reference_workload.warm_up(prompts, "bench_throughput warm-up")


def run_hf(path: str, prompts, max_tokens, batch: int = 64) -> tuple[float, int]:
    """transformers generate, static left-padded batches of `batch`, sampling like ours."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    total, started = 0, time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(order), batch):
            idx = order[b:b + batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx]).cuda()
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i])
                                 for i in idx]).cuda()
            new = max(max_tokens[i] for i in idx)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
            total += sum(max_tokens[i] for i in idx)   # count only what each request asked for
    torch.cuda.synchronize()
    return time.perf_counter() - started, total


async def generate_all(address: str, prompts, params) -> int:
    """Send every request at once to a served engine; the number of output tokens."""
    from conveyor.client import AsyncClient

    async with AsyncClient(address) as client:
        results = await asyncio.gather(*(client.generate(p, sp)
                                         for p, sp in zip(prompts, params)))
    return sum(len(r.token_ids) for r in results)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: the offline GPU budget (conveyor.shared.config.TOKEN_BUDGETS)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                    help="the largest step replayed from a CUDA graph (default: the engine's)")
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                    help="one step at a time (no overlap of scheduling and the GPU)")
    ap.add_argument("--tp", type=int, default=None, help="run in `conveyor serve --tp N`")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="with --tp: NCCL for every all-reduce (A/B of the one-shot kernel)")
    ap.add_argument("--compare-hf", action="store_true")
    ap.add_argument("--json", help="append the result as a JSON line to this file")
    args = ap.parse_args()

    if args.compare_hf and args.tp is not None:
        ap.error("--compare-hf runs one GPU: leave out --tp")
    path = model_path(args, ap)
    if args.compare_hf and args.load_format == "dummy":
        ap.error("--compare-hf needs a saved checkpoint, not --load-format dummy")

    from conveyor import LLM, SamplingParams
    from conveyor.shared.config import TOKEN_BUDGETS

    prompts, max_tokens = workload(args.num_requests)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    engine = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens or TOKEN_BUDGETS["cuda", True],
                  enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                  max_cudagraph_capture_size=args.max_cudagraph_capture_size,
                  disable_custom_all_reduce=args.disable_custom_all_reduce,
                  load_format=args.load_format, **quant_args(args))
    t0 = time.perf_counter()
    if args.tp is None:
        llm = LLM(model=path, device="cuda", skip_tokenizer_init=True, **engine)
        startup = time.perf_counter() - t0
        if llm.quantization_report is not None:
            print(llm.quantization_report.summary())
        for batch in warm_up(prompts):
            llm.generate(batch, SamplingParams(temperature=0.6, max_tokens=8), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        kv_blocks = llm.runner.num_blocks
    else:
        with served(path, args.tp, *engine_flags(engine)) as client:
            startup = time.perf_counter() - t0
            address = client.address
            warm = SamplingParams(temperature=0.6, max_tokens=8)
            for batch in warm_up(prompts):
                asyncio.run(generate_all(address, batch, [warm] * len(batch)))
            t0 = time.perf_counter()
            out_tokens = asyncio.run(generate_all(address, prompts, params))
            elapsed = time.perf_counter() - t0
        kv_blocks = None                                  # in the worker processes
    result = {"shape": args.shape or path, "requests": len(prompts),
              "prompt_tokens": sum(map(len, prompts)), "output_tokens": out_tokens,
              "seconds": round(elapsed, 3), "tok_per_s": round(out_tokens / elapsed, 1),
              "startup_s": round(startup, 1), "eager": args.enforce_eager,
              "max_cudagraph_capture_size": args.max_cudagraph_capture_size,
              "async_scheduling": args.async_scheduling, "tp": args.tp or 1,
              "load_format": args.load_format, "kv_cache_dtype": args.kv_cache_dtype,
              "kv_blocks": kv_blocks, "quantization": args.quantization}
    print(f"conveyor: {out_tokens} output tokens in {elapsed:.2f} s = "
          f"{out_tokens / elapsed:,.0f} tok/s (startup {startup:.1f} s, KV cache "
          f"{args.kv_cache_dtype}: {result['kv_blocks']} blocks)")
    if args.compare_hf:
        del llm
        hf_s, hf_tokens = run_hf(path, prompts, max_tokens)
        result["hf_tok_per_s"] = round(hf_tokens / hf_s, 1)
        print(f"transformers: {hf_tokens} tokens in {hf_s:.1f} s = {hf_tokens / hf_s:,.0f} tok/s;"
              f" ratio {result['tok_per_s'] / result['hf_tok_per_s']:.1f}x")
    append_json(args.json, result)


if __name__ == "__main__":
    main()
