"""The skinny (single-row decode) GEMM against x.float() @ W.float().T rounded once, on fresh
random inputs: odd shapes, K past whole blocks, bias, the fused SiLU-and-mul input.

Under Triton's CPU interpreter a program costs milliseconds: the shapes keep programs few.
"""
import pytest
import torch

from conveyor.kernels.skinny_gemm import M_MAX, skinny_gemm, skinny_gemm_ref, takes, tiling

pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]

TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def inputs(n, k, dtype, device, bias=False, x_cols=None):
    """x [1, x_cols or k], W [n, k] scaled so that y ~ N(0, 1), bias [n]."""
    x = torch.randn(1, x_cols or k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,bias", [
    (1, 64, False),             # one row of W, K below one block
    (37, 1000, True),           # K past whole blocks, N past whole programs
    (100, 3000, True),
    (4096, 1024, False),        # Qwen3-0.6B qkv
    (6144, 64, True),           # 8 rows a program, one block
    (20000, 96, False),
    (2112, 600, False),         # 8 rows, K past whole 256-column stages
])
def test_matches_the_float_product(device, dtype, n, k, bias):
    x, w, b = inputs(n, k, dtype, device, bias)
    torch.testing.assert_close(skinny_gemm(x, w, b), skinny_gemm_ref(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("n,k", [(1024, 3072), (37, 1000)])
def test_fused_silu_and_mul_input(device, n, k):
    x, w, b = inputs(n, k, torch.bfloat16, device, bias=True, x_cols=2 * k)
    x = x * 3
    got = skinny_gemm(x, w, b, silu_mul=True)
    torch.testing.assert_close(got, skinny_gemm_ref(x, w, b, silu_mul=True),
                               **TOL[torch.bfloat16])


def test_takes_only_what_it_can_do():
    w = torch.empty(8, 64, dtype=torch.bfloat16)
    assert takes(torch.empty(M_MAX, 64, dtype=torch.bfloat16), w)
    assert not takes(torch.empty(M_MAX + 1, 64, dtype=torch.bfloat16), w)
    assert not takes(torch.empty(1, 64, dtype=torch.float32), w.float())
    assert not takes(torch.empty(1, 64, dtype=torch.float16), w)
    assert not takes(torch.empty(64, 1, dtype=torch.bfloat16).T[:, ::2], w)


def test_tiling_of_the_benchmark_shapes():
    """8 rows a program where that gives two programs per SM (132 SMs), else 4; 4 KB of W a
    pipeline stage (8 KB with silu_mul); the measured choices."""
    for n, k, silu in [(4096, 1024, 0), (1024, 2048, 0), (6144, 1024, 0), (1024, 3072, 1),
                       (151936, 1024, 0), (6144, 4096, 0), (4096, 4096, 0), (28672, 4096, 0),
                       (4096, 14336, 1), (128256, 4096, 0)]:
        for weight_bytes in (1, 2):
            block_n, block_k = tiling(n, k, weight_bytes, bool(silu), sms=132)
            assert block_n == (8 if n >= 2 * 132 * 8 else 4)
            assert block_n * block_k * weight_bytes == 4096 * (2 if silu else 1)
    assert tiling(1024, 3072, 2, True) == (4, 1024)          # Qwen3-0.6B's down: 4 rows
    assert tiling(28672, 4096, 1) == (8, 512)                 # Llama's gate/up in fp8
    assert tiling(4096, 14336, 1, True) == (8, 1024)
    assert tiling(8, 40) == (4, 64)                           # K below one stage: one block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_replays_in_a_cuda_graph():
    """As the decode graphs run it: captured once, replayed on new inputs."""
    cases = [inputs(n, k, torch.bfloat16, "cuda")[:2] for n, k in [(1024, 3072), (8192, 128)]]
    for x, w in cases:
        skinny_gemm(x, w)                                    # warm-up: compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [skinny_gemm(x, w) for x, w in cases]
    for _ in range(3):
        for x, _ in cases:
            x.copy_(torch.randn_like(x))
        graph.replay()
        for out, (x, w) in zip(outs, cases):
            torch.testing.assert_close(out, skinny_gemm_ref(x, w), **TOL[torch.bfloat16])
