"""Tensor parallelism on two GPUs: `conveyor serve --tp 2` gives the same greedy tokens as
`--tp 1` on a random Llama-3.1-8B-shaped model (every layer, bf16)."""
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

PROMPTS = [[5, 100, 2000, 31, 7, 999, 4242, 17, 256, 3000], list(range(300, 341)),
           [9] * 3 + list(range(1000, 1150)), list(range(7000, 7600, 3))]


def test_tp2_equals_tp1(tmp_path):
    from bench_models import build_random_model, served

    from conveyor import SamplingParams

    path = str(build_random_model("llama3.1-8b", tmp_path / "llama", initializer_range=0.05))
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        with served(path, tp, "--max-model-len", "2048") as client:
            tokens[tp] = [r.token_ids for r in client.generate(PROMPTS, greedy)]
    assert tokens[2] == tokens[1]
