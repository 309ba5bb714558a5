"""Tensor parallelism on 2, 4 and 8 GPUs: `conveyor serve --tp N` against `--tp 1` on a random
Llama-3.1-8B-shaped model (every layer, bf16; 32 heads / 8 KV heads, so TP=8 holds one KV head
per rank), through the ZMQ client. A TP size runs where there are that many GPUs. The sizes sum
partial results in different orders, so bf16 rounding differs: greedy tokens must be equal, or at
the first divergence each side's token must be in the other's top 20. That is STYLE.md's rule
with 20 for 5, as for the fp8 KV test's random model: this model's logits are flat (its top 3
often within 0.3 nats) and 32 layers amplify a rounding difference to a few tenths of a nat.
Measured on two H200s, over the 8 first divergences of TP=2 against TP=1 (4 prompts, NCCL and
the one-shot all-reduce), each side's token ranked at most 5th in the other's list with NCCL and
at most 7th with the one-shot kernel (which is checked bitwise against NCCL's sum in
tests/e2e/test_gpu_all_reduce.py; the two runs differ by the norm's rounding). TP=2 runs with
the one-shot all-reduce and without it. Also load_format=dummy: the weights every rank draws are
the same at TP=1 and at the largest TP."""

import pytest
import torch
from serve_util import assert_top5_close

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

PROMPTS = [[5, 100, 2000, 31, 7, 999, 4242, 17, 256, 3000], list(range(300, 341)),
           [9] * 3 + list(range(1000, 1150)), list(range(7000, 7600, 3))]
TOP = 20
SIZES = (2, 4, 8)


def generate(path: str, tp: int, *args: str):
    from benchmarks.models import served
    from conveyor import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=TOP)
    with served(path, tp, "--max-model-len", "2048", *args) as client:
        return client.generate(PROMPTS, greedy)


def assert_close_greedy(reference, results, tp: int) -> None:
    """Equal tokens, or each side's token in the other's top TOP at the first divergence."""
    assert all(len(r.token_ids) == 32 for r in reference + results)
    first = assert_top5_close([r.outputs[0] for r in reference], [r.outputs[0] for r in results])
    print(f"tp={tp}: first differing token of each prompt (None: all 32 equal): {first}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from benchmarks.models import build_random_model

    return str(build_random_model("llama3.1-8b", tmp_path_factory.mktemp("llama"),
                                  initializer_range=0.05))


@pytest.fixture(scope="module")
def tp1(checkpoint):
    return generate(checkpoint, 1)


@pytest.mark.parametrize("tp,extra", [(2, ()), (2, ("--disable-custom-all-reduce",)),
                                      (4, ()), (8, ())])
def test_tp_matches_tp1(tp, extra, checkpoint, tp1):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    assert_close_greedy(tp1, generate(checkpoint, tp, *extra), tp)


def test_dummy_weights_match_tp1_at_the_largest_tp(tmp_path):
    from benchmarks.models import build_random_model

    tp = max(t for t in SIZES if t <= torch.cuda.device_count())
    path = str(build_random_model("llama3.1-8b", tmp_path, weights=False,
                                  initializer_range=0.05))
    dummy = ("--load-format", "dummy")
    assert_close_greedy(generate(path, 1, *dummy), generate(path, tp, *dummy), tp)
