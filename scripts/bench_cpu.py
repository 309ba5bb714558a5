"""Offline throughput on CPU: conveyor's LLM.generate against transformers' generate.

Workload (issue 2): 32 prompts of 32-256 random tokens, 64 new tokens each (ignore EOS, greedy),
then one prompt alone for single-stream decode speed. Both engines run the same model in the same
process, one after the other. Prints a table; record it in docs/BENCHMARKS.md.

    .venv/bin/python scripts/bench_cpu.py [--model PATH] [--num-prompts 32] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import random
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
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    from conveyor import LLM
    from conveyor.shared.model_files import resolve_model

    llm = LLM(model=args.model)
    vocab = llm.engine.model_config.vocab_size
    prompts = workload(args.num_prompts, args.min_len, args.max_len, vocab)
    rows = []
    t, n = run_conveyor(llm, prompts, args.new_tokens)
    rows.append(("conveyor", f"batch of {len(prompts)}", n, t))
    t, n = run_conveyor(llm, prompts[:1], args.single_new_tokens)
    rows.append(("conveyor", "single prompt", n, t))
    del llm

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        files = resolve_model(args.model)
        if files.is_gguf:
            model = AutoModelForCausalLM.from_pretrained(files.folder, gguf_file=files.path.name,
                                                         dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32)
        model.eval()
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
        t, n = run_hf(model, prompts, args.new_tokens, pad)
        rows.append(("transformers", f"batch of {len(prompts)}", n, t))
        t, n = run_hf(model, prompts[:1], args.single_new_tokens, pad)
        rows.append(("transformers", "single prompt", n, t))

    print(f"\ntorch threads: {torch.get_num_threads()}")
    print(f"{'engine':<14}{'workload':<18}{'tokens':>8}{'seconds':>10}{'tok/s':>10}")
    for engine, what, n, t in rows:
        print(f"{engine:<14}{what:<18}{n:>8}{t:>10.2f}{n / t:>10.1f}")
    if not args.skip_hf:
        print(f"ratio batch: {rows[0][2] / rows[0][3] / (rows[2][2] / rows[2][3]):.2f}x, "
              f"single: {rows[1][2] / rows[1][3] / (rows[3][2] / rows[3][3]):.2f}x")


if __name__ == "__main__":
    main()
