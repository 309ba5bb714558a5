"""The bitmask kernel against its torch reference on odd shapes, and the reference against a
plain loop over the bits."""
import pytest
import torch

from conveyor.kernels.token_bitmask import (
    allowed_ref,
    apply_token_bitmask,
    apply_token_bitmask_ref,
)


def _random_case(n, v, r, w, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v + 3, generator=g) * 3).to(dtype)[:, :v]          # strided rows
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (r, w), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1                                                            # all allowed
    if r > 1:
        bitmask[1] = 0                                                         # none allowed
    rows = torch.randperm(n, generator=g)[:r]
    return logits.to(device), bitmask.to(device), rows.to(device)


def test_reference_matches_bits():
    logits, bitmask, rows = _random_case(7, 100, 4, 4, torch.float32, "cpu")
    before = logits.clone()
    apply_token_bitmask_ref(logits, bitmask, rows)
    for i in range(7):
        for t in range(100):
            if i in rows.tolist():
                r = rows.tolist().index(i)
                allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            else:
                allowed = 1
            assert logits[i, t] == (before[i, t] if allowed else float("-inf"))


def test_short_bitmask_bans_the_tail():
    allowed = allowed_ref(torch.full((2, 1), -1, dtype=torch.int32), 40)
    assert allowed[:, :32].all() and not allowed[:, 32:].any()


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,v,r,w", [(1, 37, 1, 2), (5, 123, 3, 4), (9, 5000, 9, 157),
                                     (3, 151936, 2, 4748), (4, 1000, 2, 20)])
def test_kernel_matches_reference(device, dtype, n, v, r, w):
    logits, bitmask, rows = _random_case(n, v, r, w, dtype, device)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
