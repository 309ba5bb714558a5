"""benchmarks/kernel_timings.py's read-ceiling kernel reads every byte it is given: each program's
output is the XOR of its own 8 KB, on fresh random data."""
import functools
import operator

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]


def test_each_program_xors_its_own_block(device):
    from benchmarks.kernel_timings import READ_BLOCK, read
    x = torch.randint(-2**31, 2**31 - 1, (3 * READ_BLOCK,), dtype=torch.int32, device=device)
    want = [functools.reduce(operator.xor, chunk.tolist()) for chunk in x.view(3, -1).cpu()]
    assert read(x).cpu().tolist() == want
