"""The weight-quantized GEMMs against their torch references on fresh random inputs: the skinny
GEMV reading int8/fp8 weights (row and group scales, fused SiLU-and-mul), the W8A16 tiled GEMM,
per-token fp8 quantization, and the fp8 W8A8 GEMM (its Triton tiles; torch._scaled_mm on the GPU).

Under Triton's CPU interpreter a program costs milliseconds: the shapes keep programs few.
"""
import pytest
import torch

from conveyor.kernels.dequantize import dequantize, dequantize_ref
from conveyor.kernels.int8_gemm import int8_gemm, int8_gemm_ref, tiling
from conveyor.kernels.quant_fp8 import quant_fp8, quant_fp8_ref
from conveyor.kernels.skinny_gemm import skinny_gemm, skinny_gemm_ref, takes
from conveyor.worker.layers.quantization import quantize_weight

DTYPES = [torch.bfloat16, torch.float16]
# the kernels round once; the references dequantize W to x's dtype first (int8_gemm_ref) or not
TOL = {torch.float16: dict(atol=3e-3, rtol=3e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def quantized(n, k, device, mode="int8", groups=1):
    """A random weight [n, k] scaled so that y ~ N(0, 1), quantized per row, or (groups > 1)
    with random int8 values and one random scale per k / groups columns (as GGUF Q8_0)."""
    if groups == 1:
        q, s = quantize_weight(torch.randn(n, k, device=device) / k ** 0.5, mode)
        return q, s
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    return q, torch.rand(n, groups, device=device) / (127 * k ** 0.5) * 2


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,groups,bias", [
    (1, 64, 1, False),
    (37, 1000, 1, True),          # K past whole blocks, N past whole programs
    (100, 96, 3, True),           # group scales (GGUF Q8_0: 32 columns each)
    (6144, 64, 2, False),         # 8 rows a program
])
def test_skinny_int8(device, dtype, n, k, groups, bias):
    w, s = quantized(n, k, device, groups=groups)
    x = torch.randn(1, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    torch.testing.assert_close(skinny_gemm(x, w, b, scale=s), skinny_gemm_ref(x, w, b, scale=s),
                               **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.interpreter
def test_skinny_int8_reads_every_byte_exactly(device):
    """Row i holds the int8 value i - 128 in one column: y is that value, to the last bit (the
    kernel builds floats from the weight bytes with integer ops, -128 and 127 included)."""
    k = 64
    w = torch.zeros(256, k, dtype=torch.int8, device=device)
    w[:, 5] = torch.arange(-128, 128, device=device).to(torch.int8)
    x = torch.zeros(1, k, device=device, dtype=torch.bfloat16)
    x[0, 5] = 1.0
    y = skinny_gemm(x, w, scale=torch.ones(256, 1, device=device))
    assert torch.equal(y.float(), torch.arange(-128, 128, device=device).float()[None])


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(37, 1000), (300, 128)])
def test_skinny_fp8_weights(device, dtype, n, k):
    w, s = quantized(n, k, device, "fp8")
    x = torch.randn(1, k, device=device).to(dtype)
    torch.testing.assert_close(skinny_gemm(x, w, scale=s), skinny_gemm_ref(x, w, scale=s),
                               **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("groups", [1, 4])
def test_skinny_int8_with_fused_silu_and_mul(device, groups):
    n, k = 40, 256
    w, s = quantized(n, k, device, groups=groups)
    x = torch.randn(1, 2 * k, device=device).to(torch.bfloat16) * 3
    torch.testing.assert_close(skinny_gemm(x, w, silu_mul=True, scale=s),
                               skinny_gemm_ref(x, w, silu_mul=True, scale=s),
                               **TOL[torch.bfloat16])


def test_skinny_takes_only_what_it_can_do():
    x = torch.empty(1, 64, dtype=torch.bfloat16)
    w = torch.empty(8, 64, dtype=torch.int8)
    assert takes(x, w, torch.empty(8, 1)) and takes(x, w, torch.empty(8, 2))
    assert takes(x, w.view(torch.float8_e4m3fn), torch.empty(8, 1))
    assert not takes(x, w)                                        # int8 needs a scale
    assert not takes(x, w, torch.empty(8, 3))                     # 3 groups do not divide 64
    assert not takes(x, w, torch.empty(8, 1, dtype=torch.float16))
    assert not takes(x, w, torch.empty(8, 2)[:, :1])              # not contiguous
    assert not takes(x, torch.empty(8, 64, dtype=torch.bfloat16), torch.empty(8, 1))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,groups,bias", [
    (2, 37, 1000, 1, True),       # odd N and K, decode-sized M
    (17, 70, 96, 3, False),       # group scales, 32-row tiles
    (40, 33, 128, 1, True),       # 64-row tiles
    (65, 130, 200, 1, True),      # 128-row tiles, K not a whole step
    (300, 129, 64, 2, False),     # several M tiles
    (20, 100, 1024, 1, True),     # K split in four: the last program of a tile adds them
    (33, 190, 512, 4, False),     # K split in four, group scales
    (150, 16900, 64, 1, False),   # 256-row tiles (a weight of 265 tiles)
])
def test_int8_gemm(device, dtype, m, n, k, groups, bias):
    w, s = quantized(n, k, device, groups=groups)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    torch.testing.assert_close(int8_gemm(x, w, s, b), int8_gemm_ref(x, w, s, b), **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(16, 4096, 4096), (100, 4096, 14336), (7, 6144, 4096)])
def test_int8_gemm_split_k_is_deterministic(m, n, k):
    """Split-K shapes of Llama-8B's projections: every call gives the same bits (the partials
    are added in a fixed order, not by atomics), and the tile counts start at zero each call."""
    assert tiling(m, n, k)[4] > 1
    w, s = quantized(n, k, "cuda")
    x = torch.randn(m, k, device="cuda").bfloat16()
    first = int8_gemm(x, w, s)
    torch.testing.assert_close(first, int8_gemm_ref(x, w, s), **TOL[torch.bfloat16])
    for _ in range(20):
        assert torch.equal(int8_gemm(x, w, s), first)


def test_int8_gemm_tiling():
    """Tiles grow with M up to 128 rows (256 on a weight of 264 or more tiles); K is split
    while a call has fewer than 256 programs, into parts that are whole K steps; tiles are
    whole tensor-core shapes."""
    sizes = [tiling(m, 4096, 4096)[0] for m in (1, 16, 17, 64, 65, 256, 257, 8192)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128
    assert tiling(256, 28672, 4096)[0] == 256 and tiling(128, 28672, 4096)[0] == 128
    for m in (2, 8, 16, 32, 64, 128, 256, 1023):
        for n in (1024, 4096, 6144, 28672, 151936):
            for k in (1000, 1024, 4096, 14336):
                block_m, block_k, _, _, split = tiling(m, n, k)
                programs = -(-m // block_m) * -(-n // 64)
                assert split in (1, 2, 4)
                assert split == 1 or (k % (split * block_k) == 0 and programs * split <= 256)
                assert block_m % 16 == 0 and block_k % 64 == 0
    assert tiling(16, 4096, 4096)[4] == 4 and tiling(16, 28672, 4096)[4] == 1
    assert tiling(16, 4096, 1000)[4] == 1                      # K not whole steps: no split


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,n,k,groups", [("int8", 5, 3000, 1), ("int8", 33, 96, 3),
                                             ("fp8", 7, 1000, 1)])
def test_dequantize(device, dtype, mode, n, k, groups):
    w, s = quantized(n, k, device, mode, groups)
    assert torch.equal(dequantize(w, s, dtype), dequantize_ref(w, s, dtype))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 64), (5, 1000), (3, 2500), (4, 14336)])
def test_quant_fp8_matches_torch_rounding(device, dtype, m, k):
    rows = torch.logspace(-2, 2, m, device=device)[:, None]       # amax from 0.01 to 100
    x = (torch.randn(m, k, device=device) * rows).to(dtype)
    x[0, :7] = 0
    q, s = quant_fp8(x)
    q_ref, s_ref = quant_fp8_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.interpreter
def test_quant_fp8_of_a_zero_row_is_zero(device):
    q, s = quant_fp8(torch.zeros(2, 40, device=device, dtype=torch.bfloat16))
    assert (q.float() == 0).all() and (s > 0).all()


def same_fp8(a, b):
    """Two (q, scale) pairs equal to the bit."""
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 48), (5, 1000), (3, 14336)])
def test_quant_fp8_silu_mul_equals_the_two_kernels(device, dtype, m, k):
    """Fused, silu(gate) * up is quantized to the same bytes as silu_and_mul then quant_fp8,
    and close to torch's silu."""
    from conveyor.kernels.silu_and_mul import silu_and_mul

    x = (torch.randn(m, 2 * k, device=device) * 4).to(dtype)
    x[0, :5] = 0                                         # zeros, and a zero gate
    got = quant_fp8(x, silu_mul=True)
    same_fp8(got, quant_fp8(silu_and_mul(x)))
    q_ref, s_ref = quant_fp8_ref(x, silu_mul=True)
    torch.testing.assert_close(got[1], s_ref, rtol=1e-2, atol=0)
    torch.testing.assert_close(got[0].float() * got[1], q_ref.float() * s_ref,
                               rtol=0.07, atol=1e-2 * s_ref.max().item())


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 123), (3, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_equals_rms_norm_then_quant_fp8(device, dtype, rows, cols, with_residual):
    from conveyor.kernels._util import Fp8Rows
    from conveyor.kernels.rms_norm import rms_norm

    x = torch.randn(rows, cols, device=device).to(dtype) * 3
    w = torch.randn(cols, device=device).to(dtype)
    res = torch.randn_like(x) if with_residual else None
    got, want = rms_norm(x, w, 1e-6, res, fp8=True), rms_norm(x, w, 1e-6, res)
    if with_residual:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert isinstance(got, Fp8Rows) and got.dtype == dtype and got.shape == (rows, cols)
    same_fp8(got, quant_fp8(want))


@pytest.mark.gpu
@pytest.mark.interpreter
def test_rms_norm_fp8_with_a_float32_weight_rounds_like_the_two_kernels(device):
    """The normed rows are float32 then (torch's promotion): two kernels, not the fused one."""
    from conveyor.kernels.rms_norm import rms_norm

    x = torch.randn(4, 200, device=device, dtype=torch.bfloat16)
    w = torch.randn(200, device=device)
    got, want = rms_norm(x, w, 1e-6, fp8=True), rms_norm(x, w, 1e-6)
    assert want.dtype == got.dtype == torch.float32
    same_fp8(got, quant_fp8(want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 tensor cores")
def test_fp8_gemm_of_fp8_rows_and_silu_mul_equals_unfused():
    """What the decoder layer hands an fp8 layer (rows quantized by the norm, or the gate/up
    output for the down projection) gives the product of the unfused path to the bit."""
    from conveyor.kernels._util import Fp8Rows
    from conveyor.kernels.fp8_gemm import fp8_gemm, supported
    from conveyor.kernels.silu_and_mul import silu_and_mul

    if not supported(torch.device("cuda")):
        pytest.skip("needs compute capability 8.9+")
    w, s = quantized(96, 320, "cuda", "fp8")
    x = torch.randn(7, 320, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fp8_gemm(Fp8Rows(*quant_fp8(x), x.dtype), w, s, b), fp8_gemm(x, w, s, b))
    gate_up = torch.randn(7, 640, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fp8_gemm(gate_up, w, s, silu_mul=True),
                       fp8_gemm(silu_and_mul(gate_up), w, s))
    rows = Fp8Rows(*quant_fp8(x), x.dtype)
    with pytest.raises(ValueError, match="silu_mul"):         # rows are already activated
        fp8_gemm(rows, w, s, silu_mul=True)
    with pytest.raises(ValueError, match="Fp8Rows"):          # K of another layer
        fp8_gemm(Fp8Rows(rows.q[:, :304], rows.scale, x.dtype), w, s)
    with pytest.raises(ValueError, match="Fp8Rows"):          # one scale a row, float32
        fp8_gemm(Fp8Rows(rows.q, rows.scale.half(), x.dtype), w, s)
    with pytest.raises(ValueError, match="Fp8Rows"):
        fp8_gemm(Fp8Rows(rows.q, rows.scale[:3], x.dtype), w, s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tensors")
def test_fp8_gemm_takes_only_rows_quant_fp8_holds():
    """A longer K would fail in quant_fp8; the layer takes the float reference instead."""
    from conveyor.kernels.fp8_gemm import takes
    from conveyor.kernels.quant_fp8 import MAX_K

    x = torch.empty(2, MAX_K + 16, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(16, MAX_K + 16, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(16, 1, device="cuda")
    assert not takes(x, w, s)
    assert takes(x[:, :MAX_K], w[:, :MAX_K].contiguous(), s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 tensor cores")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias", [(2, 48, 64, False), (37, 1024, 512, True),
                                        (300, 4096, 1024, True)])   # Triton tiles; cuBLAS
def test_fp8_gemm(dtype, m, n, k, bias):
    from conveyor.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, supported

    if not supported(torch.device("cuda")):
        pytest.skip("needs compute capability 8.9+")
    w, s = quantized(n, k, "cuda", "fp8")
    x = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    # the product comes out of _scaled_mm in bf16 (its row-wise scaling has no fp16 output), so
    # fp16 gets bf16's tolerance (measured failing at fp16's: M = 37, N = 1024, K = 512, when
    # that size went to cuBLAS)
    torch.testing.assert_close(fp8_gemm(x, w, s, b), fp8_gemm_ref(x, w, s, b),
                               **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [(128, 128, 128, 8, 3), (64, 128, 128, 4, 4),
                                   (64, 64, 256, 4, 3), (64, 32, 256, 4, 4)])
@pytest.mark.parametrize("m,n,k,bias", [(5, 48, 512, True),      # one partial tile, whole K steps
                                        (70, 208, 272, False)])  # partial tiles every way
def test_fp8_gemm_tiles(device, dtype, tiles, m, n, k, bias):
    """Each tiling of the Triton kernel (fp8_gemm's path for decode batches on Hopper) against
    the float32 reference, on rows quantized by the reference."""
    from conveyor.kernels._util import Fp8Rows
    from conveyor.kernels.fp8_gemm import fp8_gemm_ref, tiled

    w, s = quantized(n, k, device, "fp8")
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    got = tiled(Fp8Rows(*quant_fp8_ref(x), dtype), w, s, b, tiles)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got, fp8_gemm_ref(x, w, s, b), **TOL[dtype])


def test_fp8_gemm_tiling():
    """Every SM gets a program where a 32-row weight tile can give it one; tiles narrow as the
    batch shrinks; the Llama-3.1-8B choices are the measured ones (132 SMs, docs/BENCHMARKS)."""
    from conveyor.kernels.fp8_gemm import TILED_TO_M, tiling

    for m in range(1, TILED_TO_M + 1, 7):
        for n in (1024, 4096, 6144, 28672, 151936):
            block_m, block_n, block_k, warps, stages = tiling(m, n, 132)
            programs = -(-m // block_m) * -(-n // block_n)
            assert programs >= 132 or block_n == 32
            assert (block_m, warps) in ((64, 4), (128, 8)) and block_k in (128, 256)
    llama = {(n, m): tiling(m, n, 132)[:2] for n in (4096, 6144, 28672) for m in (64, 128, 256)}
    assert llama == {(4096, 64): (64, 32), (4096, 128): (64, 32), (4096, 256): (64, 64),
                     (6144, 64): (64, 32), (6144, 128): (64, 64), (6144, 256): (64, 128),
                     (28672, 64): (64, 128), (28672, 128): (128, 128),
                     (28672, 256): (128, 128)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 tensor cores")
@pytest.mark.parametrize("m", [64, 128, 256])
def test_fp8_gemm_at_llama_sizes(m):
    """Llama-3.1-8B's four projections at decode batch sizes (every tiling fp8_gemm picks there
    on an H200), against the float32 reference."""
    from conveyor.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, supported

    if not supported(torch.device("cuda")):
        pytest.skip("needs compute capability 8.9+")
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        w, s = quantized(n, k, "cuda", "fp8")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(fp8_gemm(x, w, s), fp8_gemm_ref(x, w, s),
                                   **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_quantized_linears_replay_in_a_cuda_graph():
    """As the decode graphs run them: captured once, replayed on new inputs (M = 1: skinny int8
    and fp8; M = 8: the W8A16 GEMM and the fp8 GEMM)."""
    from conveyor.kernels.fp8_gemm import fp8_gemm_ref, supported
    from conveyor.worker.layers.linear import linear

    cases = [(1, "int8"), (8, "int8")]
    if supported(torch.device("cuda")):
        cases += [(1, "fp8"), (8, "fp8")]
    ops = []
    for m, mode in cases:
        w, s = quantized(1024, 2048, "cuda", mode)
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        # fp8 at one row: the skinny GEMV reads the fp8 weight, x stays bf16 (W8A16-like)
        ref = int8_gemm_ref if mode == "int8" else fp8_gemm_ref if m > 1 else None
        ops.append((x, w, s, ref))
        linear(x, w, scale=s)                                # warm-up: compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [linear(x, w, scale=s) for x, w, s, _ in ops]
    for _ in range(2):
        for x, *_ in ops:
            x.copy_(torch.randn_like(x))
        graph.replay()
        for out, (x, w, s, ref) in zip(outs, ops):
            want = skinny_gemm_ref(x, w, scale=s) if ref is None else ref(x, w, s)
            torch.testing.assert_close(out, want, **TOL[torch.bfloat16])
