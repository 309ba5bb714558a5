"""Single-stream latency: decode ms per output token at batch 1, and time to first token for a
1024-token prompt (fresh random prompts, so the prefix cache never helps).

    python scripts/bench_latency.py --shape qwen3-0.6b --random-weights
    python scripts/bench_latency.py --shape llama3.1-8b --random-weights --tp 2   # via serve
    python scripts/bench_latency.py --shape llama3.1-70b --random-weights --tp 8  # dummy weights
    python scripts/bench_latency.py --shape llama3.1-8b --random-weights --kv-cache-dtype fp8
    python scripts/bench_latency.py --shape llama3.1-8b --random-weights --quantization int8

With --tp the model runs in `conveyor serve` (one worker per GPU) and is timed through the ZMQ
client, so the figure includes the processes' messages; without it, in-process (LLM).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.models import (
    add_model_args,
    append_json,
    engine_flags,
    model_path,
    quant_args,
    served,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tp", type=int, default=None, help="run in `conveyor serve --tp N`")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="with --tp: NCCL for every all-reduce (A/B of the one-shot kernel)")
    ap.add_argument("--json")
    args = ap.parse_args()
    path = model_path(args, ap)
    engine = dict(max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=4096,
                  enforce_eager=args.enforce_eager, load_format=args.load_format,
                  disable_custom_all_reduce=args.disable_custom_all_reduce,
                  **quant_args(args))
    if args.tp is None:
        from conveyor import LLM

        llm = LLM(model=path, device="cuda", skip_tokenizer_init=True, **engine)
        if llm.quantization_report is not None:
            print(llm.quantization_report.summary())
        measure(args, lambda prompt, p: llm.generate([prompt], p, use_tqdm=False))
        return
    with served(path, args.tp, *engine_flags(engine)) as client:
        measure(args, client.generate)


def measure(args, generate) -> None:
    from conveyor import SamplingParams

    rng = random.Random(0)

    def prompt(n):
        return [rng.randint(0, 10000) for _ in range(n)]

    def timed(n_prompt, n_out):
        p = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n_out)
        t0 = time.perf_counter()
        generate(prompt(n_prompt), p)
        return time.perf_counter() - t0

    # warm-up: every shape timed below once (a Triton kernel compiles on its first new shape)
    timed(args.prompt_len, 1), timed(16, 1), timed(16, args.decode_tokens + 1)
    ttft = [timed(args.prompt_len, 1) for _ in range(args.repeat)]
    short = [timed(16, 1) for _ in range(args.repeat)]
    long = [timed(16, args.decode_tokens + 1) for _ in range(args.repeat)]
    per_token = (statistics.median(long) - statistics.median(short)) / args.decode_tokens
    result = {"shape": args.shape or args.model, "decode_ms_per_token": round(per_token * 1e3, 3),
              "ttft_ms": round(statistics.median(ttft) * 1e3, 2),
              "prompt_len": args.prompt_len, "eager": args.enforce_eager, "tp": args.tp,
              "load_format": args.load_format, "kv_cache_dtype": args.kv_cache_dtype,
              "quantization": args.quantization}
    print(f"decode: {per_token * 1e3:.3f} ms/token (batch 1); TTFT for {args.prompt_len} "
          f"tokens: {statistics.median(ttft) * 1e3:.1f} ms")
    append_json(args.json, result)


if __name__ == "__main__":
    main()
