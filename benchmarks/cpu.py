"""Offline throughput on CPU: conveyor's LLM.generate against transformers' generate.

Workload (issue 2): 32 prompts of 32-256 random tokens, 64 new tokens each (ignore EOS, greedy),
then one prompt alone for single-stream decode speed. Both engines run the same model in the same
process, alternating, --repeat times. Prints a table; record it in docs/BENCHMARKS.md.

    .venv/bin/python scripts/bench_cpu.py [--model PATH] [--num-prompts 32] [--repeat 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 10000)) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def run_conveyor(llm, prompts, new_tokens: int) -> tuple[float, int]:
    from conveyor import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(model, prompts, new_tokens: int, pad_id: int) -> tuple[float, int]:
    """Batched generate: left-padded to the longest prompt, as a transformers user would."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4,
                       do_sample=False, pad_token_id=pad_id)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        elapsed = time.perf_counter() - t
    return elapsed, (out.shape[1] - width) * len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--single-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3,
                    help="alternate the engines this many times and report medians "
                         "(a shared 2-core machine is noisy)")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    from conveyor import LLM
    from conveyor.shared.model_files import resolve_model

    # NOTE: no prefix caching, so repeated runs of the same prompts recompute them in full.
    llm = LLM(model=args.model, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    prompts = workload(args.num_prompts, args.min_len, args.max_len, vocab)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        files = resolve_model(args.model)
        if files.is_gguf:
            hf = AutoModelForCausalLM.from_pretrained(files.folder, gguf_file=files.path.name,
                                                      dtype=torch.float32)
        else:
            hf = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32)
        hf.eval()
        pad = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0

    runs: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for _ in range(args.repeat):
        for what, batch, new in (("batch", prompts, args.new_tokens),
                                 ("single", prompts[:1], args.single_new_tokens)):
            t, n = run_conveyor(llm, batch, new)
            runs.setdefault(("conveyor", what), []).append((n, t))
            if hf is not None:
                t, n = run_hf(hf, batch, new, pad)
                runs.setdefault(("transformers", what), []).append((n, t))

    def rate(key) -> float:
        return statistics.median(n / t for n, t in runs[key])

    print(f"\ntorch threads: {torch.get_num_threads()}, runs each: {args.repeat} (median)")
    print(f"{'engine':<14}{'workload':<10}{'tokens':>8}{'tok/s':>10}  all runs")
    for (engine, what), rs in runs.items():
        print(f"{engine:<14}{what:<10}{rs[0][0]:>8}{rate((engine, what)):>10.1f}  "
              + " ".join(f"{n / t:.1f}" for n, t in rs))
    if hf is not None:
        for what in ("batch", "single"):
            ratio = rate(("conveyor", what)) / rate(("transformers", what))
            print(f"ratio {what}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
