"""The W4A16 Triton kernels against the torch reference (dequantize, then matmul): one row
(decode) to prefill sizes, N and K off the tiles, group sizes 32, 64, 128 and whole rows, with
a bias and with an act-order column order, bf16 and fp16."""
import pytest
import torch

from conveyor.kernels.w4a16_gemm import pack_int4, w4a16_gemm, w4a16_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,group", [(1, 4096, 4096, 128), (1, 1000, 384, 32),
                                         (7, 333, 256, 64), (64, 2048, 1024, 128),
                                         (300, 520, 640, 0), (1500, 256, 512, 32)])
@pytest.mark.parametrize("bias,act_order", [(False, False), (True, True)])
def test_w4a16_matches_reference(dtype, m, n, k, group, bias, act_order):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    groups = k // group if group else 1
    q = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
    words = pack_int4(q)
    scale = torch.rand(n, groups, device="cuda", generator=gen) / 50
    zero = torch.randint(0, 16, (n, groups), device="cuda", generator=gen).float()
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    perm = torch.randperm(k, device="cuda", generator=gen) if act_order else None
    want = w4a16_ref(x.float(), words, scale, zero, None if b is None else b.float(), perm)
    got = w4a16_gemm(x, words, scale, zero, b, perm)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("m,n,k,group,act_order", [
    (1, 40, 128, 32, False), (5, 40, 128, 64, True), (70, 40, 128, 0, False),
    (40, 40, 48, 16, True),
    # K split in parts: 4 (groups of 128), 3 (groups of 64, scaled a word at a time) and
    # 2 uneven ones (one group of 640 inputs)
    (3, 200, 1024, 128, False), (17, 72, 1152, 64, True), (1, 136, 640, 0, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_small(m, n, k, group, act_order, dtype, device):
    """Small shapes, also under Triton's interpreter on the CPU: the tiled kernel (a few rows,
    K whole or split) and dequantize-then-cuBLAS (many); bf16 and fp16 (their own magic
    numbers for the weights' bit patterns)."""
    check_small(m, n, k, group, act_order, device, atol=3e-2, dtype=dtype)


def check_small(m: int, n: int, k: int, group: int, act_order: bool, device, atol: float,
                dtype: torch.dtype = torch.bfloat16):
    """w4a16_gemm against the reference on random 4-bit weights (group 0: one group a row),
    twice: a split's tile counts must be back at 0."""
    gen = torch.Generator(device=device).manual_seed(m)
    groups = k // group if group else 1
    q = torch.randint(0, 16, (n, k), device=device, generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, groups, device=device, generator=gen) / 20
    zero = torch.randint(0, 16, (n, groups), device=device, generator=gen).float()
    x = torch.randn(m, k, device=device, generator=gen).to(dtype)
    perm = torch.randperm(k, device=device, generator=gen) if act_order else None
    want = w4a16_ref(x.float(), pack_int4(q), scale, zero, None, perm)
    for _ in range(2):
        got = w4a16_gemm(x, pack_int4(q), scale, zero, None, perm)
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=3e-2)


@pytest.mark.interpreter
def test_w4a16_takes_groups_of_16_inputs(device):
    """The tiled kernel steps through K inside one group: groups of 24 inputs (or a float32 x)
    go to dequantize-then-matmul instead, which linear() picks through `takes`."""
    from conveyor.kernels.w4a16_gemm import takes

    words = torch.zeros(8, 48 // 8, dtype=torch.int32, device=device)
    x = torch.zeros(1, 48, dtype=torch.bfloat16, device=device)
    assert takes(x, words, torch.zeros(8, 3, device=device))          # groups of 16
    assert not takes(x, words, torch.zeros(8, 2, device=device))      # groups of 24
    assert not takes(x.float(), words, torch.zeros(8, 3, device=device))


@pytest.mark.interpreter
@pytest.mark.parametrize("m,n,k,group", [(33, 40, 256, 128), (100, 136, 1024, 64),
                                         (130, 72, 640, 0)])
def test_w4a16_tiles_of_rows(m, n, k, group, device, monkeypatch):
    """The tensor-core kernel over several tiles of 64 rows (with the dequantize path moved
    past them), K whole or split, groups scaled after the step or a word at a time. (Groups
    below 128 round each scaled weight to bf16 before its dot: 5e-2 over 1,024 inputs.)"""
    from conveyor.kernels import w4a16_gemm as mod

    monkeypatch.setattr(mod, "CUBLAS_FROM_M", 1 << 20)
    check_small(m, n, k, group, False, device, atol=5e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("n,k,group,tile,parts", [
    (40, 256, 128, (64, 16, 4), None),      # one group a step, N off the tile
    (72, 1152, 64, (32, 16, 4), 3),         # two groups a step: a word's own scale
    (136, 640, 0, (64, 32, 4), 2),          # one group a row, K off the 256-input step
    (40, 48, 16, (32, 16, 4), None),        # K below one step
    (200, 1024, 128, (128, 32, 8), 4)])
def test_w4a16_gemv(n, k, group, tile, parts, device):
    """The CUDA-core GEMV (one row: single-stream decode) over tiles and K parts off its defaults,
    against the reference: bias, act order, bf16 and fp16; twice, the tile counts back at 0."""
    from conveyor.kernels import w4a16_gemm as mod

    m = 1
    gen = torch.Generator(device=device).manual_seed(k + n)
    groups = k // group if group else 1
    q = torch.randint(0, 16, (n, k), device=device, generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, groups, device=device, generator=gen) / 20
    zero = torch.randint(0, 16, (n, groups), device=device, generator=gen).float()
    perm = torch.randperm(k, device=device, generator=gen)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        b = torch.randn(n, device=device, generator=gen).to(dtype)
        want = w4a16_ref(x.float(), pack_int4(q), scale, zero, b.float(), perm)
        for _ in range(2):
            got = mod._gemv(x[:, perm].contiguous(), pack_int4(q), scale, zero, b,
                            torch.empty(m, n, dtype=dtype, device=device), tile, parts)
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
