"""Speculative decoding: what n-gram or draft-model guesses buy on input-grounded work, and what
a verify step costs.

throughput: output tokens/s at batch 1, 4, 16, 64 with and without speculation, each request
asked to rewrite a given text (its own sentences, shuffled), so the output copies its input, as
editing and summarising do; `--work open` asks open questions instead, whose answers copy
little (what speculation costs where it does not pay). Greedy unless --temperature. Real
weights (with a tokenizer): the default model unless --model. --method draft_model guesses
with --draft-model (a smaller model with the same tokenizer), or with the target's own first
--draft-num-layers layers; each row gives the acceptance rate and the mean accepted length
(tokens a verifying sequence step yields).
The engines stay loaded and take turns over --rounds passes of each batch, each pass on prompts
of its own; the closing table gives the first round's figures and each round's ratio.

replay: the plans speculation makes on the work (which verify, which only look for guesses,
which overlap), with and without backing off, from the default model's greedy outputs replayed
through the scheduler (no model in the loop after recording them).

verify: the host-to-result time of a step that verifies k guesses (1 + k query tokens) against
a one-token decode step, at --batch sequences of --context tokens, run on the model runner
directly (the guesses are always rejected, so each step advances one token and the contexts
stay comparable). --shape with --random-weights takes a shape's random weights.

    python scripts/bench_speculative.py throughput                       # default model
    python scripts/bench_speculative.py throughput --model Qwen/Qwen3-8B --batches 1 4 16 64
    python scripts/bench_speculative.py throughput --work open --batches 1 4
    python scripts/bench_speculative.py verify --shape llama3.1-8b --random-weights
    python scripts/bench_speculative.py replay --work open --batch 4 --device cpu
    python scripts/bench_speculative.py throughput --batches 1 2 --max-tokens 16 --device cpu
    python scripts/bench_speculative.py throughput --method draft_model --draft-num-layers 8 \
        --shape qwen3-0.6b --random-weights --batches 1 4
    python scripts/bench_speculative.py verify --steps 5 --device cpu    # tiny, on the CPU
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from benchmarks.models import add_model_args, append_json, model_path

SENTENCES = [
    "The committee met on Tuesday to review the budget for the coming year.",
    "It approved the new library on the north side of the river.",
    "Road repairs on the main street were delayed until the spring.",
    "Members asked the city engineer for a report on the water supply.",
    "The mayor thanked the volunteers who cleaned the park after the storm.",
    "A proposal to extend the bus line to the airport was sent back for study.",
    "Residents spoke for and against a plan to widen the bridge.",
    "The school board will present its enrolment figures next month.",
    "Funding for the summer reading programme was increased by ten percent.",
    "The meeting closed with a vote to publish all minutes online.",
]


def grounded_prompts(n: int, seed: int = 0) -> list[str]:
    """n requests to rewrite a text, each its own order of the sentences."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        text = " ".join(rng.sample(SENTENCES, len(SENTENCES)))
        prompts.append(f"Rewrite the following text exactly, fixing nothing:\n\n{text}\n\n"
                       f"Rewritten text:\n\n")
    return prompts


QUESTIONS = [
    "Write a short story about a cat who learns to fly.",
    "Explain how a refrigerator works to a child.",
    "Give me three ideas for a birthday party in winter.",
    "What were the main causes of the French Revolution?",
    "Describe a day in the life of a lighthouse keeper.",
    "Why is the sky blue? Answer in a few paragraphs.",
    "Plan a three-day trip to a city you like.",
    "What makes a good teacher? Give examples.",
]


def open_prompts(n: int, seed: int = 0) -> list[str]:
    """n open questions, each led by a number of its own (no two share a cached prefix)."""
    rng = random.Random(seed)
    return [f"Request {rng.randrange(10 ** 6)}. {rng.choice(QUESTIONS)}\n\nAnswer:\n"
            for _ in range(n)]


PROMPTS = {"grounded": grounded_prompts, "open": open_prompts}   # --work


def throughput(args, path: str | None) -> None:
    from conveyor import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True)
    spec = {"method": args.method}
    if args.method == "ngram":
        spec.update(prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max)
    else:
        spec.update({k: v for k, v in (("model", args.draft_model),
                                       ("draft_num_layers", args.draft_num_layers)) if v})
    if args.disable_by_batch_size:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    # NOTE: the engines (the baseline, one for each k) stay loaded and take turns, batch by batch
    # and round by round, so a drift of the machine (clocks, other load) hits all alike; each
    # (round, batch) has its own prompts, so no pass re-hits a prefix cached in an earlier one
    configs = {"baseline": None} | {k: {**spec, "num_speculative_tokens": k} for k in args.k}
    share = ({"gpu_memory_utilization": round(0.8 / len(configs), 2)}
             if args.device != "cpu" else {})
    engines = {}
    for name, config in configs.items():
        engines[name] = LLM(model=path, device=args.device, max_num_seqs=max(args.batches),
                            max_model_len=args.max_model_len, load_format=args.load_format,
                            speculative_config=config, **share)
    make = PROMPTS[args.work]
    for llm in engines.values():
        llm.generate(make(1, seed=99), params, use_tqdm=False)                # warm-up
    rates: dict[tuple[str | int, int], list[float]] = {}
    for r in range(args.rounds):
        for batch in args.batches:
            prompts = make(batch, seed=1000 * r + batch)
            for name, llm in engines.items():
                result = _timed(llm, prompts, params, "baseline" if name == "baseline"
                                else args.method, batch)
                result["round"] = r
                if name != "baseline":
                    result["k"] = name
                    if args.method == "draft_model":
                        result["draft"] = {k: spec.get(k)
                                           for k in ("model", "draft_num_layers")}
                rates.setdefault((name, batch), []).append(result["tokens_per_s"])
                print(result, flush=True)
                append_json(args.json, result)
    print(f"\n{'batch':>5} {'':>12} {'baseline tok/s':>15} {'tok/s':>8} {'ratio':>7}   "
          f"ratio in each of {args.rounds} rounds (the first is the figure)")
    for batch in args.batches:
        base = rates["baseline", batch]
        for k in args.k:
            spec_rates, name = rates[k, batch], f"{args.method} k={k}"
            print(f"{batch:>5} {name:>12} {base[0]:>15,.0f} {spec_rates[0]:>8,.0f} "
                  f"{spec_rates[0] / base[0]:>6.2f}x   "
                  + ", ".join(f"{s / b:.2f}x" for s, b in zip(spec_rates, base)))


def _timed(llm, prompts: list[str], params, name: str, batch: int) -> dict:
    """One timed pass of `prompts`: tokens/s and, speculating, the acceptance."""
    before = llm.engine.scheduler.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    after = llm.engine.scheduler.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    runs = after.spec_num_drafts - before.spec_num_drafts
    return {"bench": "speculative-throughput", "mode": name, "batch": batch,
            "output_tokens": tokens, "seconds": round(dt, 3),
            "tokens_per_s": round(tokens / dt, 1),
            "acceptance": round(accepted / drafts, 3) if drafts else None,
            "mean_accepted_length": round(1 + accepted / runs, 2) if runs else None}


def verify_step(args, path: str | None) -> None:
    from conveyor.shared.config import EngineConfig
    from conveyor.shared.messages.worker import NewSeq, SeqStep, StepPlan
    from conveyor.shared.model_files import read_model_config, resolve_model
    from conveyor.shared.sampling_params import SamplingParams
    from conveyor.worker.model_runner import ModelRunner

    bs, batch, k = 16, args.batch, args.k[0]
    length = args.context + (args.steps + 2) * (k + 1) + 16
    config = EngineConfig(model=path, device=args.device, load_format=args.load_format,
                          max_num_seqs=max(batch, 1), max_model_len=length, block_size=bs,
                          num_kv_blocks=batch * -(-length // bs) + 1,
                          speculative_config={"method": "ngram", "num_speculative_tokens": k}
                          ).with_defaults(offline=True)
    files = resolve_model(path)
    model = read_model_config(files)
    runner = ModelRunner(config, model, files, length)
    vocab = model.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, ignore_eos=True)
    # each sequence: its blocks (all of them up front), its computed tokens and table entries
    tables = [list(range(1 + i * -(-length // bs), 1 + (i + 1) * -(-length // bs)))
              for i in range(batch)]
    prompt = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(batch)]
    held = [-(-args.context // bs)] * batch
    computed = [args.context] * batch
    step = 1
    runner.execute(StepPlan(step, [NewSeq(i, prompt[i], args.context, params,
                                          tables[i][:held[i]], 0) for i in range(batch)],
                            [SeqStep(i, args.context, [], True) for i in range(batch)], []))
    times: dict[int, list[float]] = {0: [], k: []}
    for guesses in [0, k] * (args.steps + 1):
        seqs = []
        for i in range(batch):
            need = -(-(computed[i] + 1 + guesses) // bs)
            seqs.append(SeqStep(i, 1 + guesses, tables[i][held[i]:need], True, -1,
                                [vocab - 1 - j for j in range(guesses)]))
            held[i] = max(held[i], need)
        step += 1
        if args.device == "cuda":
            import torch

            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = runner.execute(StepPlan(step, [], seqs, []))
        times[guesses].append(time.perf_counter() - t0)
        counts = result.num_sampled or [1] * batch
        for i, n in enumerate(counts):
            computed[i] += n                       # the accepted guesses and the step's token
            held[i] = min(held[i], -(-computed[i] // bs))
    ms = {g: 1e3 * statistics.median(t[1:]) for g, t in times.items()}   # the first: warm-up
    result = {"bench": "speculative-verify", "batch": batch, "context": args.context, "k": k,
              "decode_ms": round(ms[0], 3), "verify_ms": round(ms[k], 3),
              "ratio": round(ms[k] / ms[0], 3)}
    print(result, flush=True)
    append_json(args.json, result)


def replay(args, path: str | None) -> None:
    """The work's greedy outputs (one pass of --batch requests, no speculation) replayed through
    the scheduler with n-gram lookups: a stand-in worker draws the recorded tokens (accepting
    the guesses that match them) and looks up guesses as the worker would, so the plans are
    those the engine makes, without the model. Per policy (verifying every guess at hand, or
    backing off where guesses do not pay: scheduler/speculation.py), the plans, those that
    verify (each runs alone: the next is planned after its result) and those planned beside
    another one in flight (overlapped)."""
    from collections import deque

    from conveyor import LLM, SamplingParams
    from conveyor.scheduler import speculation
    from conveyor.scheduler.scheduler import Scheduler
    from conveyor.shared.config import EngineConfig
    from conveyor.shared.messages.engine import AddRequest
    from conveyor.shared.messages.worker import StepResult
    from conveyor.worker.spec.ngram import NgramIndex

    make = PROMPTS[args.work]
    llm = LLM(model=path, device=args.device, max_model_len=args.max_model_len,
              load_format=args.load_format)
    outs = llm.generate(make(args.batch, seed=args.seed),
                        SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                       ignore_eos=True), use_tqdm=False)
    recorded = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outs}
    lo, hi = args.lookup_min, args.lookup_max
    print(f"{'k':>3} {'policy':>10} {'plans':>6} {'verify':>7} {'overlapped':>11} "
          f"{'tokens/plan':>12}")
    for k, (name, wait) in itertools.product(args.k, (("always", 0),
                                                      ("back-off", speculation.MAX_SPEC_WAIT))):
        config = EngineConfig(block_size=16, max_num_seqs=args.batch, speculative_config={
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": hi}).with_defaults(offline=True)
        saved, speculation.MAX_SPEC_WAIT = speculation.MAX_SPEC_WAIT, wait
        try:
            scheduler = Scheduler(config, 4096, (), args.max_model_len)
            for i, prompt in enumerate(recorded):
                scheduler.add(AddRequest(id=str(i), token_ids=list(prompt), sampling=SamplingParams(
                    temperature=0, max_tokens=len(recorded[prompt]), ignore_eos=True)))
            slots: dict[int, tuple[list[int], list[int], int]] = {}
            flight, counts = deque(), {"plans": 0, "verify": 0, "overlapped": 0}
            while scheduler.has_work():
                while scheduler.can_schedule() and (plan := scheduler.schedule()) is not None:
                    verifies = any(q.draft_token_ids for q in plan.seqs)
                    counts["plans"] += 1
                    counts["verify"] += verifies
                    counts["overlapped"] += bool(flight)
                    flight.append(plan)
                plan = flight.popleft()
                for slot in plan.freed:
                    slots.pop(slot, None)
                for new in plan.new:
                    slots[new.slot] = (list(new.token_ids), recorded[
                        tuple(new.token_ids[:new.prompt_len])], new.prompt_len)
                sampled, runs, proposals = [], [], []
                for q in plan.seqs:
                    if not q.sample:
                        continue
                    tokens, output, prompt_len = slots[q.slot]
                    nxt = output[len(tokens) - prompt_len:]
                    a = 0
                    while (a < min(len(q.draft_token_ids), len(nxt))
                           and q.draft_token_ids[a] == nxt[a]):
                        a += 1
                    drawn = nxt[:a + 1] or [0]
                    tokens += drawn
                    sampled += drawn
                    runs.append(len(drawn))
                    if plan.propose:
                        proposals.append(NgramIndex(lo, hi).guess(tokens, k))
                scheduler.update(StepResult(plan.step, sampled, [None] * len(sampled), [],
                                            num_sampled=runs, proposals=proposals))
        finally:
            speculation.MAX_SPEC_WAIT = saved
        total = sum(map(len, recorded.values()))
        print(f"{k:>3} {name:>10} {counts['plans']:>6} {counts['verify']:>7} "
              f"{counts['overlapped']:>11} {total / counts['plans']:>12.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["throughput", "verify", "replay"])
    add_model_args(ap)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--k", type=int, nargs="+", default=[4],
                    help="num_speculative_tokens (throughput and replay: each, side by side)")
    ap.add_argument("--work", choices=list(PROMPTS), default="grounded",
                    help="throughput: rewrite a given text (grounded) or answer open questions")
    ap.add_argument("--method", choices=["ngram", "draft_model"], default="ngram",
                    help="throughput: the proposer")
    ap.add_argument("--draft-model", default=None,
                    help="draft_model: the draft's folder (default: the target itself)")
    ap.add_argument("--draft-num-layers", type=int, default=None,
                    help="draft_model: draft with the first N layers of the draft (or target)")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3,
                    help="throughput: passes of each batch, the engines taking turns")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1,
                    help="verify: sequences per step; replay: requests")
    ap.add_argument("--seed", type=int, default=7,
                    help="replay: the prompts' (throughput's round r, batch b: 1000 r + b)")
    ap.add_argument("--context", type=int, default=1024, help="verify: tokens of context")
    ap.add_argument("--steps", type=int, default=50, help="verify: steps of each kind")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.model is None and not args.shape:
        path = None                                 # the default model
        args.load_format = args.load_format or "auto"
    else:
        path = model_path(args, ap)
    if args.method == "draft_model" and not (args.draft_model or args.draft_num_layers):
        ap.error("--method draft_model needs --draft-model or --draft-num-layers")
    {"throughput": throughput, "verify": verify_step, "replay": replay}[args.what](args, path)


if __name__ == "__main__":
    main()
