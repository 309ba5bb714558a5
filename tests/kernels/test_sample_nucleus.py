"""Top-p / min-p sampling by rejection: every draw is in the row's nucleus (computed exactly in
float64, without the kernel's method), draws follow the softmax restricted to it, the kernel
matches its torch reference round for round (exactly under the interpreter; on the GPU up to
the fast log2's rounding), and a row's draw depends only on its own row, parameters and seed.

On CPU under Triton's interpreter each program costs tens of ms a read, so the row counts there
are small.
"""
import pytest
import torch
from test_sample import assert_follows, logits, random_keys

from conveyor.kernels import interpreting
from conveyor.kernels.sample_nucleus import nucleus_ref, sample_nucleus, sample_nucleus_ref

pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]

SLOW = interpreting() and not torch.cuda.is_available()


def column(values, device):
    return torch.tensor(values, dtype=torch.float32, device=device)


def draw(x, rows, t, top_p, min_p, seeds):
    device = x.device
    rows = torch.tensor(rows, dtype=torch.long, device=device)
    return sample_nucleus(x, rows, column(t, device), column(top_p, device),
                          column(min_p, device), seeds)


def assert_in_nucleus(got, x, rows, t, top_p, min_p):
    for i, row in enumerate(rows):
        keep = nucleus_ref(x[row].float().cpu(), t[i], top_p[i], min_p[i])
        assert keep[got[i]], (i, got[i].item(), int(keep.sum()))


CASES = [  # (temperature, top_p, min_p)
    (0.7, 0.9, 0.0), (1.0, 0.5, 0.0), (1.5, 1.0, 0.1), (0.5, 0.05, 0.0), (1.0, 0.95, 0.05),
    (2.0, 0.3, 0.0), (1.0, 1e-6, 0.0), (0.8, 0.99, 0.5),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("v", [37, 5000])
def test_draws_are_in_the_nucleus_and_match_the_reference(device, dtype, v):
    n = len(CASES)
    x = logits(n + 2, v, dtype, device)                 # strided rows; two are not drawn
    rows = [2, 0, 3, 4, 5, 6, 7, 9][:n]
    t, top_p, min_p = ([c[k] for c in CASES] for k in range(3))
    seeds = random_keys(n, device)
    got = draw(x, rows, t, top_p, min_p, seeds)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert_in_nucleus(got, x, rows, t, top_p, min_p)
    ref = sample_nucleus_ref(x, torch.tensor(rows, device=device), column(t, device),
                             column(top_p, device), column(min_p, device), seeds)
    if SLOW:
        assert torch.equal(got, ref)
    else:   # the GPU's log2 is approximate: a near-tie of two scores may go either way
        assert (got == ref).float().mean() >= 0.75


def test_a_tiny_top_p_is_greedy(device):
    """top_p below the top token's probability leaves only the top logit, even in a flat row of
    151,936. In bf16 the top value is often tied (about one row in seven here), and ties at the
    boundary are kept whole, so the draw is one of the tied top tokens."""
    n = 2 if SLOW else 64
    x = logits(n, 151936, torch.bfloat16, device, scale=0.5, pad=64)
    got = draw(x, list(range(n)), [1.0] * n, [1e-6] * n, [0.0] * n, random_keys(n, device))
    top = x.float().max(-1).values
    assert torch.equal(x.float().gather(1, got[:, None])[:, 0], top)


@pytest.mark.parametrize("top_p,min_p", [(0.8, 0.0), (1.0, 0.2), (0.9, 0.1)])
def test_draws_follow_the_restricted_softmax(device, top_p, min_p):
    n, t = (300 if SLOW else 20000), 0.9
    row = torch.randn(37, device=device) * 2
    x = row[None].expand(n, -1)                         # one row, n draws (stride 0)
    got = draw(x, [0] * n, [t] * n, [top_p] * n, [min_p] * n, random_keys(n, device))
    keep = nucleus_ref(row.cpu(), t, top_p, min_p)
    probs = (row.cpu().double() / t).softmax(-1) * keep
    assert keep[got.cpu()].all()
    assert_follows(got, probs / probs.sum())


def test_the_reference_follows_the_restricted_softmax():
    """The reference, many draws (the kernel matches it draw for draw above)."""
    n, t, top_p, min_p = 3000, 1.2, 0.7, 0.02
    row = torch.randn(37) * 2
    got = sample_nucleus_ref(row[None].expand(n, -1), torch.zeros(n, dtype=torch.long),
                             torch.full((n,), t), torch.full((n,), top_p),
                             torch.full((n,), min_p), random_keys(n, "cpu"))
    keep = nucleus_ref(row, t, top_p, min_p)
    probs = (row.double() / t).softmax(-1) * keep
    assert_follows(got, probs / probs.sum())


def test_a_row_depends_only_on_its_own_seed(device):
    x = logits(5, 3000, torch.bfloat16, device)
    t, top_p, min_p = [1.0, 0.7, 1.3, 1.0, 0.9], [0.9, 0.5, 0.95, 0.8, 1.0], [0, 0, 0, 0.1, 0.05]
    seeds = random_keys(5, device)
    batch = draw(x, [0, 1, 2, 3, 4], t, top_p, min_p, seeds)
    assert torch.equal(batch, draw(x, [0, 1, 2, 3, 4], t, top_p, min_p, seeds))
    for i in (1, 3):
        alone = draw(x, [i], t[i:i + 1], top_p[i:i + 1], min_p[i:i + 1], seeds[i:i + 1])
        assert alone.item() == batch[i].item()


def test_ties_at_the_boundary_are_kept_whole(device):
    """Four tokens of equal logit share the boundary: all four are kept, none of the rest."""
    x = torch.full((1, 50), -20.0, device=device)
    x[0, 10:14] = 2.0
    x[0, 30] = 3.0
    n = 200 if SLOW else 4000
    got = draw(x.expand(n, -1), [0] * n, [1.0] * n, [0.5] * n, [0.0] * n,
               random_keys(n, device))
    assert set(got.tolist()) <= {10, 11, 12, 13, 30}
    assert set(got.tolist()) >= {10, 11, 12, 13}


def test_empty(device):
    x = logits(2, 37, torch.float32, device)
    assert draw(x, [], [], [], [], random_keys(0, device)).shape == (0,)
