"""The reference offline workload (issue 4, Nano-vLLM's benchmark), in a module of its own that
imports nothing heavy: scripts/bench_scheduler.py times the torch-free scheduler with it, and
importing torch there would make every garbage collection walk torch's objects too.

256 requests, random.seed(0); prompt = random token ids in [0, 10000], lengths uniform in
[100, max_input]; max_tokens uniform in [100, max_output].
"""
from __future__ import annotations

import random


def workload(num_requests: int = 256, max_input: int = 1024, max_output: int = 1024):
    """(prompts, max_tokens) of the reference workload."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
               for _ in range(num_requests)]
    max_tokens = [random.randint(100, max_output) for _ in range(num_requests)]
    return prompts, max_tokens
