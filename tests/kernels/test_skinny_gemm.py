"""The skinny (decode) GEMM against x.float() @ W.float().T rounded once, on fresh random inputs:
odd shapes, K past whole blocks, split-K, bias, strided rows, the fused SiLU-and-mul input.

Under Triton's CPU interpreter a program costs milliseconds: the shapes keep programs few.
"""
import pytest
import torch

from conveyor.kernels.skinny_gemm import M_MAX, skinny_gemm, skinny_gemm_ref, takes, tiling

pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]

TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def inputs(m, n, k, dtype, device, bias=False, x_cols=None, pad=8):
    """x [m, x_cols or k] with strided rows, W [n, k] scaled so that y ~ N(0, 1), bias [n]."""
    x = torch.randn(m, (x_cols or k) + pad, device=device).to(dtype)[:, :x_cols or k]
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,bias", [
    (1, 1, 64, False),          # one column, K below one block
    (3, 37, 1000, True),        # K past whole blocks
    (16, 37, 3072, False),      # split-K over a tile of 37 columns
    (2, 100, 3000, True),       # split-K, the last split partly past K
    (1, 4096, 1024, False),     # Qwen3-0.6B qkv: split-K
    (16, 6144, 64, True),       # many tiles, one masked K block
])
def test_matches_the_float_product(device, dtype, m, n, k, bias):
    x, w, b = inputs(m, n, k, dtype, device, bias)
    torch.testing.assert_close(skinny_gemm(x, w, b), skinny_gemm_ref(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("m,n,k", [(5, 1024, 3072), (1, 37, 1000)])
def test_fused_silu_and_mul_input(device, m, n, k):
    x, w, b = inputs(m, n, k, torch.bfloat16, device, bias=True, x_cols=2 * k)
    x = x * 3
    got = skinny_gemm(x, w, b, silu_mul=True)
    torch.testing.assert_close(got, skinny_gemm_ref(x, w, b, silu_mul=True),
                               **TOL[torch.bfloat16])


def test_split_k_is_deterministic(device):
    x, w, _ = inputs(16, 1024, 2048, torch.bfloat16, device)
    assert tiling(1024, 2048, 132)[1] > 1
    first = skinny_gemm(x, w)
    for _ in range(3 if device == "cpu" else 200):
        assert torch.equal(skinny_gemm(x, w), first)


def test_broadcast_rows_and_empty_batch(device):
    x, w, _ = inputs(1, 300, 256, torch.bfloat16, device)
    rows = x.expand(4, -1)                                   # stride 0, as the profiler's logits
    torch.testing.assert_close(skinny_gemm(rows, w), skinny_gemm_ref(rows, w),
                               **TOL[torch.bfloat16])
    assert skinny_gemm(x[:0], w).shape == (0, 300)


def test_takes_only_what_it_can_do():
    w = torch.empty(8, 64, dtype=torch.bfloat16)
    assert takes(torch.empty(M_MAX, 64, dtype=torch.bfloat16), w)
    assert not takes(torch.empty(M_MAX + 1, 64, dtype=torch.bfloat16), w)
    assert not takes(torch.empty(2, 64, dtype=torch.float32), w.float())
    assert not takes(torch.empty(2, 64, dtype=torch.float16), w)
    assert not takes(torch.empty(64, 2, dtype=torch.bfloat16).T, w)


def test_tiling_of_the_benchmark_shapes():
    """About two programs per SM or more (132 SMs; 32 tiles x 8 splits for N = 1024), split-K
    only where N is small, no K masks."""
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
                 (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        block_n, split, k_per_split = tiling(n, k, 132)
        assert -(-n // block_n) * split >= 256
        assert split * k_per_split == k                      # whole blocks: no masks along K


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_replays_in_a_cuda_graph():
    """As the decode graphs run it: a split-K and a plain shape captured once, replayed on new
    inputs."""
    cases = [inputs(8, n, k, torch.bfloat16, "cuda")[:2] for n, k in [(1024, 3072), (8192, 128)]]
    assert [tiling(w.shape[0], w.shape[1], 132)[1] > 1 for _, w in cases] == [True, False]
    for x, w in cases:
        skinny_gemm(x, w)                                    # warm-up: compiles, counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [skinny_gemm(x, w) for x, w in cases]
    for _ in range(3):
        for x, _ in cases:
            x.copy_(torch.randn_like(x))
        graph.replay()
        for out, (x, w) in zip(outs, cases):
            torch.testing.assert_close(out, skinny_gemm_ref(x, w), **TOL[torch.bfloat16])
