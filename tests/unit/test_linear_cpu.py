"""`linear` on the CPU: every row count, with and without a bias, equals F.linear (2-4 rows take
W x^T there, a faster path of torch's; the rest F.linear itself)."""
import pytest
import torch
import torch.nn.functional as F

from conveyor.worker.layers.linear import linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=g)
    w = torch.randn(130, 72, generator=g)
    b = torch.randn(130, generator=g) if bias else None
    y = linear(x, w, b)
    assert y.shape == (rows, 130) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
