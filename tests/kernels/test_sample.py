"""The fused sampling kernel: greedy rows are torch.argmax exactly; random rows pick the best of
the reference's scores (the same Philox draws, in torch); draws follow softmax(x / T); a row's
draw depends only on its own logits, temperature and seed.

On CPU under Triton's interpreter each program costs ~50 ms, so the row counts there are small.
"""
import math

import pytest
import torch

from conveyor.kernels import interpreting
from conveyor.kernels.sample import exp_noise_ref, race_scores_ref, sample, sample_ref

pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SLOW = interpreting() and not torch.cuda.is_available()   # Triton's CPU interpreter


def logits(n, v, dtype, device, scale=3.0, pad=5):
    """[n, v] random logits, rows strided (a slice of [n, v + pad])."""
    return (torch.randn(n, v + pad, device=device) * scale).to(dtype)[:, :v]


def random_keys(n, device):
    return torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), dtype=torch.int64, device=device)


def assert_best_of_reference(got, x, temperature, seeds):
    """Each token is a maximiser of the reference scores, up to float32 rounding (the GPU's
    log2 is an approximation); with the interpreter the tokens match exactly."""
    scores = race_scores_ref(x, temperature, seeds)
    rows = temperature >= 0
    best = scores[rows].amax(-1)
    picked = scores[rows].gather(1, got[rows, None]).squeeze(1)
    assert (picked >= best - 1e-5 * (1 + best.abs())).all()
    assert (got[~rows] == -1).all()
    if SLOW:
        assert torch.equal(got, sample_ref(x, temperature, seeds))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", [(1, 37), (3, 1000), (257, 37)])
def test_greedy_is_argmax(device, dtype, n, v):
    x = logits(n, v, dtype, device)
    assert torch.equal(sample(x), x.float().argmax(-1))


def test_greedy_ties_take_the_first_column(device):
    x = torch.randint(0, 3, (6, 9000), device=device).to(torch.bfloat16)   # many ties
    x[1] = float("-inf")                                       # torch.argmax: column 0
    x[2, :5000] = float("-inf")
    got = sample(x)
    assert torch.equal(got, x.float().argmax(-1))
    assert got[1] == 0


def test_greedy_big_vocabulary(device):
    x = logits(3, 151936, torch.bfloat16, device, pad=64)
    x[1, 151935] = 100.0                                       # the last column
    assert torch.equal(sample(x), x.float().argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", [(5, 37), (3, 5000)])
def test_random_rows_follow_the_reference(device, dtype, n, v):
    x = logits(n, v, dtype, device)
    temperature = torch.tensor([0.7, 0.0, -1.0, 1.0, 2.0][:n], device=device)
    seeds = random_keys(n, device)
    got = sample(x, temperature, seeds)
    assert_best_of_reference(got, x, temperature, seeds)
    assert got[1] == x[1].float().argmax()                     # greedy rows mix in


def test_random_rows_big_vocabulary(device):
    n = 2 if SLOW else 257
    x = logits(n, 151936, torch.bfloat16, device, scale=1.0, pad=64)
    temperature = torch.full((n,), 0.6, device=device)
    seeds = random_keys(n, device)
    assert_best_of_reference(sample(x, temperature, seeds), x, temperature, seeds)


def test_empty_batch(device):
    assert sample(torch.empty(0, 37, device=device)).shape == (0,)


def chi_square_bound(df: int, z: float = 4.75) -> float:
    """The chi-square quantile of df degrees of freedom ~1e-6 from the top (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor):
    """A chi-square test of the draws against probs, lumping cells expected below 5 times."""
    n = tokens.numel()
    observed = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.cpu().double() * n
    big = expected >= 5
    observed = torch.cat([observed[big], observed[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    chi2 = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    cells = int(keep.sum())
    if cells == 1:               # one possible token (a nucleus of one): every draw is it
        assert chi2 == 0, chi2
        return
    assert chi2 < chi_square_bound(cells - 1), chi2


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_draws_follow_the_softmax(device, temperature):
    n = 200 if SLOW else 20000
    row = torch.randn(37, device=device) * 2
    x = row.expand(n, -1)                                      # one row, n draws (stride 0)
    t, seeds = torch.full((n,), temperature, device=device), random_keys(n, device)
    got = sample(x, t, seeds)
    assert_follows(got, (row.double() / temperature).softmax(-1))
    assert_best_of_reference(got, x, t, seeds)


def test_the_noise_is_exponential_to_float32_precision():
    """E = -ln(1 - w) over the whole range of w, the small values (the likely winners) too."""
    u = torch.cat([torch.arange(0, 2 ** 20, 97), torch.randint(0, 2 ** 32, (100000,)),
                   2 ** 32 - 1 - torch.arange(0, 2 ** 20, 89),
                   torch.tensor([2 ** 28 - 1, 2 ** 28, 2 ** 31 - 1, 2 ** 31])])
    w = (u.double() + 0.5) / 2 ** 32
    exact = -torch.log1p(-w) / math.log(2)
    assert ((exp_noise_ref(u).double() - exact).abs() <= 1e-6 * exact).all()


def test_the_reference_follows_the_softmax():
    """The reference race, many draws (the kernel matches it draw for draw above)."""
    n, t = 40000, 0.8
    row = torch.randn(37) * 2
    tokens = sample_ref(row.expand(n, -1), torch.full((n,), t), random_keys(n, "cpu"))
    assert_follows(tokens, (row.double() / t).softmax(-1))


def test_big_vocabulary_with_dominant_tokens(device):
    """151,936 columns: token a has p = 0.5, token b 0.2, the other 151,934 share 0.3."""
    n, v, a, b = (16 if SLOW else 8192), 151936, 1234, 150000
    row = torch.zeros(v, device=device)
    row[a] = math.log(0.5 / 0.3 * (v - 2))
    row[b] = math.log(0.2 / 0.3 * (v - 2))
    x = row.to(torch.bfloat16).expand(n, -1)
    probs = x[0].double().softmax(-1)                          # of the rounded logits
    got = sample(x, torch.ones(n, device=device), random_keys(n, device))
    for token in (a, b):
        count = (got == token).sum().item()
        p = probs[token].item()
        assert abs(count - n * p) < 5 * math.sqrt(n * p * (1 - p)), (token, count)
    rest = got[(got != a) & (got != b)]
    assert torch.bincount(rest).max() <= 3                     # spread over the flat tail


def test_a_row_depends_only_on_its_own_seed(device):
    v = 3000
    x = logits(6, v, torch.bfloat16, device)
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.0, 1.3], device=device)
    seeds = random_keys(6, device)
    batch = sample(x, temperature, seeds)
    assert torch.equal(batch, sample(x, temperature, seeds))    # deterministic
    for i in (0, 3, 5):                                         # alone, and moved in a batch
        alone = sample(x[i:i + 1], temperature[i:i + 1], seeds[i:i + 1])
        assert alone.item() == batch[i].item()
    order = torch.tensor([5, 0, 3], device=device)
    assert torch.equal(sample(x[order], temperature[order], seeds[order]), batch[order])
    other = sample(x, temperature, seeds + 1)
    assert not torch.equal(other[[0, 2, 3, 5]], batch[[0, 2, 3, 5]])


@pytest.mark.skipif(SLOW, reason="thousands of programs: too slow for the interpreter")
def test_chunking_does_not_change_a_row():
    """Many rows split each row into fewer, longer chunks; a row's token stays the same."""
    x = logits(1, 151936, torch.bfloat16, "cuda", scale=1.0)
    t, seed = torch.ones(1, device="cuda"), random_keys(1, "cuda")
    many = sample(x.expand(300, -1), t.expand(300).contiguous(), seed.expand(300).contiguous())
    assert (many == sample(x, t, seed)).all()
