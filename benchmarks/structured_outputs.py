"""Structured outputs' cost on the engine (issue 32's goals), offline through LLM:

- decode throughput at batch BATCH with a typical JSON schema against the same requests
  unconstrained (goal: within 5 %), and with the same schema whose strings have a maxLength.
  The schema is an array of records long enough that no output completes it before MAX_TOKENS;
  ignore_eos and temperature 1 make every request run to MAX_TOKENS either way, so every pass
  decodes the same number of tokens. "Typical": strings without length bounds, as in vLLM's
  structured-output benchmark schemas and what OpenAI's strict mode accepts; bounded strings
  make a mask walk most of the vocabulary once fewer characters are left than its tokens hold
  (8x the fill of the typical schema on the default model's vocabulary), so they are reported
  beside it, not as the goal. The kinds take turns over ROUNDS rounds, each on prompts of its
  own, after a warm-up pass of each at the full batch; the first round is the figure, and the
  median of the rounds' ratios is printed beside it (a host-bound small model's passes swing
  by more than the goal's 5 % from one to the next);
- first-token delay of one request (max_tokens 1) with a schema never seen before (a fresh
  property name each trial, goal ≤ 50 ms) and with one seen before (cached, goal ≤ 1 ms), over
  the same request unconstrained; medians over TRIALS. A warm-up request builds the grammar
  library's view of the vocabulary first (once per engine).

    python scripts/bench_structured_outputs.py [--model M] [--device cuda] [--batch 64]
        [--max-tokens 256] [--trials 20]
    python scripts/bench_structured_outputs.py --shape llama3.1-8b --random-weights   # a shape
    python scripts/bench_structured_outputs.py --device cpu --batch 4 --max-tokens 8 --trials 3
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.models import add_model_args, model_path
from conveyor.shared.structured_outputs import StructuredOutputs

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["id", "name", "status", "tags", "address"],
}


# the bounded variant's maxLength of each string (by its property; the tags' items too)
MAX_LENGTHS = {"name": 24, "tags": 12, "city": 20}


def _bounded(node: dict) -> dict:
    props = {}
    for name, sub in node["properties"].items():
        if sub["type"] == "object":
            sub = _bounded(sub)
        elif sub["type"] == "string" and "enum" not in sub and "pattern" not in sub:
            sub = {**sub, "maxLength": MAX_LENGTHS[name]}
        elif sub["type"] == "array":
            sub = {**sub, "items": {**sub["items"], "maxLength": MAX_LENGTHS[name]}}
        props[name] = sub
    return {**node, "properties": props}


def schema(min_items: int, extra_property: str | None = None, bounded: bool = False) -> dict:
    """Records in an array of at least min_items (so outputs do not complete it early); with
    `bounded` each free string has a maxLength."""
    record = _bounded(RECORD) if bounded else dict(RECORD)
    if extra_property is not None:
        record["properties"] = {**record["properties"], extra_property: {"type": "boolean"}}
    return {"type": "object", "properties": {"records": {"type": "array", "items": record,
                                                         "minItems": min_items}},
            "required": ["records"]}


def _throughput(llm, prompts, params) -> tuple[float, int]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens / took, tokens


def _ttft_ms(llm, prompt, params) -> float:
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)                # neither --model nor --shape: the default model
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="throughput passes of each kind, alternated, each round on prompts of "
                         "its own; the first is the figure, the rounds' median ratio beside it")
    args = ap.parse_args()
    path = model_path(args, ap) if args.model or args.shape else None
    from conveyor import LLM, SamplingParams

    engine = {"device": args.device} if args.device else {}
    engine["load_format"] = args.load_format or "auto"
    llm = LLM(model=path, max_num_seqs=max(args.batch, 8), **engine)
    prompts = [f"Write record number {i} of the customer database as JSON:"
               for i in range(args.batch)]
    base = dict(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=None)
    items = args.max_tokens // 8 + 2
    kinds = {"unconstrained": SamplingParams(**base)}
    for name, bounded in (("json schema", False), ("json, bounded strings", True)):
        so = StructuredOutputs(json=schema(items, bounded=bounded))
        kinds[name] = SamplingParams(**base, structured_outputs=so)
    # NOTE: each kind once at the full batch first (compiles the schemas, and the kernels'
    # variants for a batch of constrained rows), on prompts no timed pass uses
    warm = [f"Write warm-up record {i} as JSON:" for i in range(args.batch)]
    for params in kinds.values():
        _throughput(llm, warm, SamplingParams(**{**base, "max_tokens": 8},
                                              structured_outputs=params.structured_outputs))
    rates = {name: [] for name in kinds}
    masks = {name: [0, 0.0, 0.0] for name in kinds}   # steps, fill s, wait s (the engine's)
    for r in range(args.rounds):      # alternate, so drift hits every kind alike
        round_prompts = [f"{p} (set {r})" for p in prompts] if r else prompts
        for name, params in kinds.items():
            before = llm.engine.scheduler.stats()
            rate, _ = _throughput(llm, round_prompts, params)
            rates[name].append(rate)
            after = llm.engine.scheduler.stats()
            for i, field in enumerate(("steps", "fill_s", "wait_s")):
                masks[name][i] += (getattr(after, f"structured_{field}")
                                   - getattr(before, f"structured_{field}"))
    first = {k: v[0] for k, v in rates.items()}
    ratios = {k: [a / b for a, b in zip(v, rates["unconstrained"])] for k, v in rates.items()}

    one = dict(temperature=0, max_tokens=1)
    prompt = prompts[0]
    plain = statistics.median(_ttft_ms(llm, prompt, SamplingParams(**one))
                              for _ in range(args.trials))
    new = statistics.median(
        _ttft_ms(llm, prompt, SamplingParams(**one, structured_outputs=StructuredOutputs(
            json=schema(2, f"field_{time.perf_counter_ns()}_{i}")))) for i in range(args.trials))
    cached_so = StructuredOutputs(json=schema(2))
    _ttft_ms(llm, prompt, SamplingParams(**one, structured_outputs=cached_so))
    cached = statistics.median(_ttft_ms(llm, prompt, SamplingParams(
        **one, structured_outputs=cached_so)) for _ in range(args.trials))

    label = f"{args.shape}, random weights" if args.shape else path or "the default model"
    print(f"{label}, {llm.config.device}, batch {args.batch}, "
          f"{args.max_tokens} tokens a request, first of {args.rounds} alternated passes")
    print(f"{'measure':<34}{'value':>14}{'goal':>16}")
    print(f"{'decode, unconstrained':<34}{first['unconstrained']:>10.1f} tok/s")
    for name in ("json schema", "json, bounded strings"):
        ratio = first[name] / first["unconstrained"]
        goal = f" (≥ 0.95x {'✓' if ratio >= 0.95 else '✗'})" if name == "json schema" else ""
        print(f"{'decode, ' + name:<34}{first[name]:>10.1f} tok/s{f'{ratio:.3f}x':>12}{goal}"
              f"   median of {args.rounds} rounds {statistics.median(ratios[name]):.3f}x")
    print(f"{'first token, unconstrained':<34}{plain:>11.2f} ms")
    for name, ms, goal in (("first token, new schema", new, 50.0),
                           ("first token, cached schema", cached, 1.0)):
        delay = ms - plain
        print(f"{name:<34}{ms:>11.2f} ms   +{delay:.2f} ms (≤ {goal:g} ms "
              f"{'✓' if delay <= goal else '✗'})")
    print("all passes, tok/s: " + "; ".join(f"{k} {', '.join(f'{r:.0f}' for r in v)}"
                                            for k, v in rates.items()))
    print("bitmask a constrained step, all passes (fill on its thread / the step loop's wait): "
          + "; ".join(f"{k} {1e3 * f / n:.2f} / {1e3 * w / n:.2f} ms"
                      for k, (n, f, w) in masks.items() if n))


if __name__ == "__main__":
    main()
