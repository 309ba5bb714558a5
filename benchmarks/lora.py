"""Multi-LoRA throughput against the base model (issue 34's goals) on the reference workload.

Three offline runs of the same requests (benchmarks/reference_workload.py; temperature 0.6,
ignore_eos), each on a fresh engine: the base model without --enable-lora; every request with
one adapter (max_loras 1); the requests spread round-robin over 8 distinct adapters (max_loras
8), so every step mixes them. The adapters are random (A and B both non-zero), rank 16 on all
seven projections (q, k, v, o, gate, up, down), written in the PEFT format. Goals: 1 adapter
>= 90 % of the base's output tokens per second, 8 adapters >= 80 %.

    python scripts/bench_lora.py --shape llama3.1-8b --random-weights
    python scripts/bench_lora.py --model FOLDER --device cpu --num-requests 8 \\
        --max-input 64 --max-output 16                      # a tiny run on the CPU
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

from benchmarks import reference_workload
from benchmarks.models import add_model_args, append_json, model_path, quant_args
from benchmarks.reference_workload import workload

PROJECTIONS = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
               "gate": "mlp", "up": "mlp", "down": "mlp"}
GOALS = {1: 0.90, 8: 0.80}


def write_adapter(folder: Path, model, rank: int, seed: int, std: float = 0.02) -> Path:
    """A random PEFT LoRA adapter for `model` (a ModelConfig) on all seven projections."""
    import torch
    from safetensors.torch import save_file

    from conveyor.shared.lora import projection_shapes

    shapes = projection_shapes(model)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_hidden_layers):
        for proj, block in PROJECTIONS.items():
            fan_in, fan_out = shapes[proj]
            stem = f"base_model.model.model.layers.{layer}.{block}.{proj}_proj"
            tensors[f"{stem}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g)
                                                * std).bfloat16()
            tensors[f"{stem}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g)
                                                * std).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_rslora": False,
        "bias": "none", "target_modules": [f"{p}_proj" for p in PROJECTIONS]}))
    return folder


def run(path: str, device: str, engine: dict, prompts, params, loras, warm) -> dict:
    """One engine, warmed up, then the timed pass; output tokens per second."""
    from conveyor import LLM, SamplingParams

    llm = LLM(model=path, device=device, skip_tokenizer_init=True, **engine)
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    for batch in warm:
        llm.generate(batch, SamplingParams(temperature=0.6, max_tokens=8), use_tqdm=False,
                     lora_request=per_prompt[:len(batch)] if loras else None)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
    return {"output_tokens": tokens, "seconds": round(elapsed, 3),
            "tok_per_s": round(tokens / elapsed, 1)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="1,8", help="adapter counts to run besides the base")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", help="append the result as a JSON line to this file")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.adapters.split(",") if c]
    path = model_path(args, ap)

    from conveyor import LoRARequest, SamplingParams
    from conveyor.shared.model_files import read_model_config, resolve_model

    small = args.max_input < 100 or args.max_output < 100
    prompts, max_tokens = workload(
        args.num_requests, args.max_input, args.max_output,
        **({"min_input": 1, "min_output": 1} if small else {}))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    warm = reference_workload.warm_up(prompts, "bench_lora warm-up")
    model = read_model_config(resolve_model(path))
    folder = Path(tempfile.mkdtemp(prefix="conveyor-lora-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(folder / f"a{i}", model,
                                                              args.rank, seed=i)))
                for i in range(max(counts, default=0))]
    engine = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  enforce_eager=args.enforce_eager, load_format=args.load_format,
                  **quant_args(args))
    result = {"shape": args.shape or path, "requests": len(prompts), "rank": args.rank,
              "device": args.device, "base": run(path, args.device, engine, prompts, params,
                                                 [], warm)}
    base = result["base"]["tok_per_s"]
    print(f"base: {base:,.0f} tok/s")
    for n in counts:
        lora = dict(engine, enable_lora=True, max_loras=n, max_lora_rank=args.rank)
        r = run(path, args.device, lora, prompts, params, adapters[:n], warm)
        r["of_base"] = round(r["tok_per_s"] / base, 3)
        result[f"adapters_{n}"] = r
        goal = GOALS.get(n)
        verdict = "" if goal is None else (f" (goal >= {goal:.0%}: "
                                           f"{'met' if r['of_base'] >= goal else 'missed'})")
        print(f"{n} adapter{'s' if n > 1 else ''}: {r['tok_per_s']:,.0f} tok/s = "
              f"{r['of_base']:.1%} of the base{verdict}")
    append_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
