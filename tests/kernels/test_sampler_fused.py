"""The Sampler on its fused-kernel path (CUDA; on CPU under Triton's interpreter, by forcing it):
greedy and temperature rows through the kernel, top-p and min-p rows through the rejection
kernel, top-k rows through torch, penalties and min_tokens bans applied first, seeded requests
independent of the batch."""
import pytest
import torch

from conveyor.shared.sampling_params import SamplingParams
from conveyor.worker import sampler as sampler_module
from conveyor.worker.sampler import Sampler, SeqSamplingState

pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]

V = 300
EOS = 7


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    monkeypatch.setattr(sampler_module, "_fused", lambda logits: True)


def states(device, *params: dict, output=()) -> list[SeqSamplingState]:
    return [SeqSamplingState.new(SamplingParams(**p), [1, 2, 3, *output], 3, device)
            for p in params]


def test_greedy_batch_is_argmax_of_the_model_dtype(device):
    logits = torch.randn(5, V + 11, device=device).to(torch.bfloat16)
    out = Sampler(V, (EOS,), 0, device).sample(logits, states(device, *[{"temperature": 0}] * 5))
    assert out.token_ids == logits[:, :V].float().argmax(-1).tolist()


def test_mixed_batch(device):
    logits = torch.randn(8, V, device=device) * 3
    logits[:, EOS] = 50.0                    # EOS is everyone's argmax
    logits[3, 11] = 40.0
    params = [
        {"temperature": 0},                                  # greedy: EOS
        {"temperature": 0, "min_tokens": 2},                 # EOS banned: the next best
        {"temperature": 0.8, "top_k": 3},                    # torch path, among the top 3
        {"temperature": 0, "repetition_penalty": 100.0},     # EOS seen: 50 / 100 < 40
        {"temperature": 1.0, "top_p": 0.5, "seed": 5},       # rejection kernel: EOS (p ~ 1)
        {"temperature": 0.7, "logprobs": 2},                 # kernel: EOS (p ~ 1)
        {"temperature": 1.0, "min_tokens": 5, "seed": 1},    # kernel, EOS banned
        {"temperature": 0, "min_p": 0.5},                    # greedy ignores min_p
    ]
    out = Sampler(V, (EOS,), 0, device).sample(logits, states(device, *params, output=(EOS,)))
    tokens = out.token_ids
    banned = logits.clone()
    banned[:, EOS] = float("-inf")
    assert tokens[0] == EOS and tokens[7] == EOS
    assert tokens[1] == banned[1].argmax().item()
    assert tokens[2] in logits[2].topk(3).indices.tolist()
    assert tokens[3] == 11
    assert tokens[4] == EOS and tokens[5] == EOS
    assert 0 <= tokens[6] < V and tokens[6] != EOS
    assert out.logprobs[5].token_ids[0] == EOS and len(out.logprobs[5].token_ids) == 3
    assert [lp is None for lp in out.logprobs] == [i != 5 for i in range(8)]


def test_top_p_and_min_p_rows(device):
    """Rows with top-p or min-p and no top-k draw within their nucleus (of the penalised,
    banned logits), strided bf16 logits and an edited float32 copy alike; a top-k row with
    top-p stays within its top k."""
    from conveyor.kernels.sample_nucleus import nucleus_ref

    logits = (torch.randn(6, V + 11, device=device) * 2).to(torch.bfloat16)
    params = [
        {"temperature": 0.8, "top_p": 0.6},
        {"temperature": 1.2, "min_p": 0.2},
        {"temperature": 1.0, "top_p": 0.9, "min_p": 0.05, "seed": 3},
        {"temperature": 1.0},                                  # the fused kernel
        {"temperature": 0.9, "top_p": 0.7, "min_tokens": 4},   # EOS banned (a float32 copy)
        {"temperature": 1.0, "top_k": 4, "top_p": 0.5},        # torch path
    ]
    sampler = Sampler(V, (EOS,), 0, device)
    for _ in range(3):
        tokens = sampler.sample(logits, states(device, *params)).token_ids
        x = logits[:, :V].float().cpu()
        x[4, EOS] = float("-inf")
        for i in (0, 1, 2, 4):
            p = params[i]
            keep = nucleus_ref(x[i], p["temperature"], p.get("top_p", 1.0), p.get("min_p", 0.0))
            assert keep[tokens[i]], (i, tokens[i])
        assert tokens[4] != EOS
        assert tokens[5] in x[5].topk(4).indices.tolist()


def test_a_seeded_request_draws_the_same_in_any_batch(device):
    logits = torch.randn(6, V, device=device)
    seeded = {"temperature": 1.0, "seed": 1234}
    alone, batched = Sampler(V, (EOS,), 0, device), Sampler(V, (EOS,), 99, device)
    for step in range(3):                    # the draw changes with the tokens generated so far
        want = alone.sample(logits[2:3], states(device, seeded, output=range(step))).token_ids
        others = [{"temperature": 1.0}, {"temperature": 0}, {"top_k": 5}]
        seeded_p = {"temperature": 1.0, "seed": 77, "top_p": 0.8}
        want_p = alone.sample(logits[4:5], states(device, seeded_p, output=range(step))
                              ).token_ids
        got_p = batched.sample(logits[[5, 4]], states(device, {"top_p": 0.5}, seeded_p,
                                                      output=range(step))).token_ids
        assert got_p[1] == want_p[0]
        got = batched.sample(logits[[0, 1, 2, 3]], states(
            device, others[0], others[1], seeded, others[2], output=range(step))).token_ids
        assert got[2] == want[0]


def test_unseeded_draws_repeat_with_the_sampler_seed_and_change_every_step(device):
    logits = torch.zeros(4, V, device=device)    # uniform: draws show the noise
    params = [{"temperature": 1.0}] * 4

    def draws(seed):
        s = Sampler(V, (EOS,), seed, device)
        return [s.sample(logits, states(device, *params)).token_ids for _ in range(3)]

    first = draws(0)
    assert first == draws(0)
    assert first != draws(1)
    assert first[0] != first[1]
