"""The reference offline workload (issue 4, Nano-vLLM's benchmark), in a module of its own that
imports nothing heavy: benchmarks/scheduler.py times the torch-free scheduler with it, and
importing torch there would make every garbage collection walk torch's objects too.

256 requests, random.seed(0); prompt = random token ids in [0, 10000], lengths uniform in
[100, max_input]; max_tokens uniform in [100, max_output] (max_input = max_output = 1024).

A benchmark that runs the workload more than once (a warm-up, several timed passes) gives each
pass other prompts of the same lengths (`salted`), so no pass finds its prompts in the prefix
cache that an earlier one filled.
"""
from __future__ import annotations

import random

MAX_TOKEN_ID = 10000


def workload(num_requests: int = 256, max_input: int = 1024, max_output: int = 1024, *,
             min_input: int = 100, min_output: int = 100):
    """(prompts, max_tokens) of the reference workload (other bounds: a smaller one, drawn the
    same way, e.g. for a CPU)."""
    random.seed(0)
    prompts = [[random.randint(0, MAX_TOKEN_ID)
                for _ in range(random.randint(min_input, max_input))]
               for _ in range(num_requests)]
    max_tokens = [random.randint(min_output, max_output) for _ in range(num_requests)]
    return prompts, max_tokens


def salted(prompts: list[list[int]], salt: str) -> list[list[int]]:
    """Prompts of the same lengths as `prompts`, their token ids (uniform in [0, 10000], like the
    workload's) drawn from a stream of their own, seeded by `salt`: two salts, or a salt and the
    seed-0 workload, share no prefix-cache block but by a chance of about 1e-64 a block."""
    rng = random.Random(f"reference-workload/{salt}")
    return [[rng.randint(0, MAX_TOKEN_ID) for _ in p] for p in prompts]


def warm_up(prompts: list[list[int]], salt: str) -> list[list[list[int]]]:
    """A warm-up's calls for `prompts`, none of them one of `prompts`: a prompt of each attention
    tile class alone (Triton compiles a variant per class; the class follows the longest query
    of a step), then 32 prompts of the lengths of the first 32 together (mixed steps of many
    sizes), their token ids from salt's stream. Run each call with a few output tokens."""
    longest = max(map(len, prompts))
    singles = [[list(range(1, min(n, longest) + 1))] for n in (3, 6, 12, 30, 600)]
    return singles + [salted(prompts[:32], salt)]
