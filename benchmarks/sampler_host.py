"""Host time a step that the sampler spends building the penalties' token tensors: ROWS sequences
with PROMPT prompt and OUTPUT output tokens, one token appended to each per step, then the padded
[rows, tokens] arrays of the outputs (every penalty) and of the prompts (repetition penalty), as
`Sampler._apply_penalties` builds them. CPU tensors, so the figure is the host work alone (on a
GPU the same arrays are then copied to the device). --from-lists converts each whole token list
every step instead, as the sampler did before it kept the arrays (revision 00dd161).

    python scripts/bench_sampler_host.py [--rows 256] [--prompt 500] [--output 1000] [--from-lists]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from conveyor.shared.sampling_params import SamplingParams
from conveyor.worker.sampler import SeqSamplingState
from conveyor.worker.sampling_ops import pad_rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=500)
    ap.add_argument("--output", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--from-lists", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    params = SamplingParams(temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.5)
    states = [SeqSamplingState.new(params, [rng.randrange(151936)
                                            for _ in range(args.prompt + args.output)],
                                   args.prompt, "cpu") for _ in range(args.rows)]
    cpu = torch.device("cpu")

    def tokens(s: SeqSamplingState):
        return s.token_ids if args.from_lists else s.token_array()

    def step():
        for s in states:
            s.token_ids.append(rng.randrange(151936))
        pad_rows([tokens(s)[s.prompt_len:] for s in states], 151936, cpu)
        pad_rows([tokens(s)[:s.prompt_len] for s in states], 151936, cpu)

    step()                                  # the first step converts each whole list once
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = (time.perf_counter() - started) / args.steps * 1e3
    print(f"{args.rows} rows, {args.prompt} prompt + ~{args.output} output tokens"
          f"{' (from lists)' if args.from_lists else ''}: {ms:.2f} ms of host time a step for "
          f"the penalties' token tensors")


if __name__ == "__main__":
    main()
