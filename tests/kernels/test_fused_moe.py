"""The fused-MoE Triton path (align, two grouped GEMMs) against the torch reference, on odd
shapes: hidden and intermediate sizes off the tiles, experts with no tokens, decode-sized and
prefill-sized batches (each tile class: 1-8, 9-32 and more rows an expert), top-k 1, 2 and 8,
bf16 and fp16; and gpt-oss's experts (biases, the clamped SwiGLU; MXFP4 weights)."""
import math

import pytest
import torch

from conveyor.kernels.fused_moe import align, fused_moe, fused_moe_ref
from conveyor.worker.layers.router import route

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,h,inter,experts,top_k", [
    (1, 128, 64, 8, 2), (7, 200, 72, 5, 2), (33, 96, 40, 16, 1), (300, 256, 96, 64, 8),
    (1000, 136, 200, 7, 3), (5, 64, 32, 128, 8), (100, 160, 48, 16, 4)])
def test_fused_moe_matches_reference(dtype, t, h, inter, experts, top_k):
    gen = torch.Generator(device="cuda").manual_seed(t * 7 + experts)
    x = torch.randn(t, h, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, h, device="cuda", generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(experts, h, inter, device="cuda", generator=gen) / inter ** 0.5).to(dtype)
    logits = torch.randn(t, experts, device="cuda", generator=gen)
    logits[:, experts // 2:] -= 4           # some experts get few tokens, or none
    weights, ids = route(logits, top_k, True, dtype)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    got = fused_moe(x, w13, w2, weights, ids)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_fused_moe_under_cuda_graph(gpt_oss):
    """align and the kernels run without host syncs: captured once, replayed on new routing
    (gpt-oss's biases and activation too)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    t, h, inter, experts, top_k = 24, 128, 64, 8, 2
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, h, device="cuda", generator=gen) / 11).bfloat16()
    w2 = (torch.randn(experts, h, inter, device="cuda", generator=gen) / 8).bfloat16()
    extra = {}
    if gpt_oss:
        extra = dict(w13_bias=torch.randn(experts, 2 * inter, device="cuda",
                                          generator=gen).bfloat16(),
                     w2_bias=torch.randn(experts, h, device="cuda", generator=gen).bfloat16(),
                     swiglu=(1.702, 1.0))
    logits = torch.randn(t, experts, device="cuda", generator=gen)
    weights, ids = route(logits, top_k, True, torch.bfloat16, gpt_oss)
    fused_moe(x, w13, w2, weights, ids, **extra)             # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids, **extra)
    new_w, new_ids = route(torch.randn(t, experts, device="cuda", generator=gen), top_k, True,
                           torch.bfloat16, gpt_oss)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids,
                         **_floats(extra))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def _floats(extra: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in extra.items()}


@pytest.mark.interpreter
@pytest.mark.parametrize("t,h,inter,experts,top_k", [(1, 96, 40, 4, 2), (21, 200, 72, 6, 3),
                                                     (300, 136, 48, 5, 2)])
@pytest.mark.parametrize("quantized", [False, True])
def test_fused_moe_gpt_oss_experts(t, h, inter, experts, top_k, quantized, device):
    """gpt-oss's experts: a bias on each expert's gate/up rows and on its down rows (the
    latter before the router weight), the clamped SwiGLU with a limit that bites, routing by a
    softmax over the top K; at each tile class, and with int8 experts (--quantization) as
    well; odd sizes."""
    from conveyor.worker.layers.quantization import quantize_weight

    gen = torch.Generator(device=device).manual_seed(t + h)
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, h, device=device, generator=gen) / h ** 0.5 * 2
    w2 = torch.randn(experts, h, inter, device=device, generator=gen) / inter ** 0.5
    b13 = torch.randn(experts, 2 * inter, device=device, generator=gen).bfloat16()
    b2 = torch.randn(experts, h, device=device, generator=gen).bfloat16()
    weights, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, True,
                         torch.bfloat16, softmax_after_topk=True)
    extra = dict(w13_bias=b13, w2_bias=b2, swiglu=(1.702, 0.7))
    scales = ()
    if quantized:
        (w13, s13), (w2, s2) = (quantize_weight(w.reshape(-1, w.shape[2]), "int8")
                                for w in (w13, w2))
        w13, w2 = w13.view(experts, 2 * inter, h), w2.view(experts, h, inter)
        scales = (s13.view(experts, 2 * inter, 1), s2.view(experts, h, 1))
        want = fused_moe_ref(x.float(), w13, w2, weights.float(), ids, *scales,
                             **_floats(extra))
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids,
                             **_floats(extra))
    got = fused_moe(x, w13, w2, weights, ids, None, *scales, **extra)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("t,top_k,weight_inputs", [(3, 2, False), (40, 3, False), (3, 1, True),
                                                   (40, 2, True)])
def test_fused_moe_small(t, top_k, weight_inputs, device):
    """Small shapes, also under Triton's interpreter on the CPU: the 16- and 32-row tiles
    chosen, and the prefill tiles; with weight_inputs (Llama 4's experts take their router
    weight on the way in) against the reference that scales the tokens."""
    gen = torch.Generator(device=device).manual_seed(t + 100 * weight_inputs)
    h, inter, experts = 48, 40, 6
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, h, device=device, generator=gen) / 7).bfloat16()
    w2 = (torch.randn(experts, h, inter, device=device, generator=gen) / 6).bfloat16()
    weights, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, False,
                         torch.bfloat16)
    if weight_inputs:
        weights = weights * 3                    # far from 1: a weight applied after shows
        after = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids,
                         weight_inputs=weight_inputs)
    if weight_inputs:
        assert not torch.allclose(want, after, atol=0.1)
    for tiles in (None, (128, 256, 64, 8, 4)):
        got = fused_moe(x, w13, w2, weights, ids, tiles, weight_inputs=weight_inputs)
        tol = 3e-2 if weight_inputs else 2e-2          # weights of up to 3: larger outputs
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_fused_moe_quantized_experts(mode, device):
    """1-byte experts with row scales: the kernel converts them as it loads and scales the
    columns; the reference dequantizes first."""
    from conveyor.worker.layers.quantization import quantize_weight

    gen = torch.Generator(device=device).manual_seed(5)
    t, h, inter, experts, top_k = 21, 64, 48, 5, 2
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
    w13, s13 = quantize_weight(torch.randn(experts * 2 * inter, h, device=device,
                                           generator=gen) / 8, mode)
    w2, s2 = quantize_weight(torch.randn(experts * h, inter, device=device, generator=gen) / 7,
                             mode)
    w13, w2 = w13.view(experts, 2 * inter, h), w2.view(experts, h, inter)
    s13, s2 = s13.view(experts, 2 * inter, 1), s2.view(experts, h, 1)
    weights, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, True,
                         torch.bfloat16)
    want = fused_moe_ref(x.float(), w13, w2, weights.float(), ids, s13, s2)
    got = fused_moe(x, w13, w2, weights, ids, None, s13, s2)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("t,h,inter,block", [(1, 96, 64, 32), (21, 160, 96, 32),
                                             (300, 256, 384, 128), (7, 128, 64, 64)])
def test_fused_moe_block_scaled_experts(t, h, inter, block, dtype, device):
    """1-byte experts with square block scales (an fp8 checkpoint's, each block row's scales
    repeated for its rows; GGUF Q8_0's int8 groups of 32 take the same path): each K step's
    weight tile is scaled by its group before its dot, at each tile class (1-8, 9-32, more
    rows an expert); the reference takes the weights dequantized to bf16, as the tiles make
    them, and computes in float32."""
    from conveyor.kernels.fused_moe import dequantize_experts

    gen = torch.Generator(device=device).manual_seed(t + h)
    experts, top_k = 6, 2
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)

    def blocked(n, k):
        w = torch.randn(experts, n, k, device=device, generator=gen) / k ** 0.5
        # blocks of magnitudes 1/16 to 1 (16x apart), so a scale applied to the wrong block shows
        size = torch.rand(experts, n // block, 1, k // block, 1, device=device, generator=gen)
        w = (w.view(experts, n // block, block, k // block, block)
             * (size * 4 - 4).exp2()).view(experts, n, k)
        amax = w.view(experts, n // block, block, k // block, block).abs().amax((2, 4))
        top = 448 if dtype == torch.float8_e4m3fn else 127
        scale = (amax / top).repeat_interleave(block, 1)                 # [E, N, K / block]
        q = w / scale.repeat_interleave(block, 2)
        return (q if dtype == torch.float8_e4m3fn else q.round()).to(dtype), scale.contiguous()

    w13, s13 = blocked(2 * inter, h)
    w2, s2 = blocked(h, inter)
    weights, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, True,
                         torch.bfloat16)
    want = fused_moe_ref(x.float(), *(dequantize_experts(w, s, None, torch.bfloat16).float()
                                      for w, s in ((w13, s13), (w2, s2))), weights.float(), ids)
    got = fused_moe(x, w13, w2, weights, ids, None, s13, s2)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("t,h,inter,group", [(1, 128, 64, 32), (21, 192, 96, 32),
                                             (300, 256, 384, 128), (5, 96, 48, 0)])
def test_fused_moe_int4_experts(t, h, inter, group, device):
    """4-bit experts (an AWQ or GPTQ checkpoint's, in kernels/w4a16_gemm.py's layout: words
    along K, scales and zero points per row and group; group 0: one a row): each K step's words
    unpacked in the tile, at each tile class; the reference dequantizes first."""
    from conveyor.kernels.w4a16_gemm import pack_int4

    gen = torch.Generator(device=device).manual_seed(t + h)
    experts, top_k = 6, 2
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)

    def int4(n, k):
        g = k // group if group else 1
        q = torch.randint(0, 16, (experts * n, k), device=device, generator=gen)
        zero = torch.randint(1, 16, (experts, n, g), device=device, generator=gen).float()
        scale = torch.rand(experts, n, g, device=device, generator=gen) / (4 * k ** 0.5)
        return pack_int4(q).view(experts, n, k // 8), scale, zero

    w13, s13, z13 = int4(2 * inter, h)
    w2, s2, z2 = int4(h, inter)
    weights, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, True,
                         torch.bfloat16)
    want = fused_moe_ref(x.float(), w13, w2, weights.float(), ids, s13, s2, z13, z2)
    got = fused_moe(x, w13, w2, weights, ids, None, s13, s2, z13, z2)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("t,h,inter,experts,top_k", [(1, 96, 64, 4, 2), (21, 160, 96, 7, 3),
                                                     (300, 224, 160, 5, 4)])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_fused_moe_mxfp4_experts(t, h, inter, experts, top_k, gpt_oss, device):
    """MXFP4 experts (gpt-oss's checkpoints, worker/mxfp4_checkpoint.py's mxfp4_words): random
    bytes, so every e2m1 code, with block exponents 8x apart, so a scale applied to the wrong
    block shows; each K step's codes decoded in the tile, at each tile class; with gpt-oss's
    biases and clamped SwiGLU, and without. The reference dequantizes first."""
    from conveyor.worker.mxfp4_checkpoint import mxfp4_words

    gen = torch.Generator(device=device).manual_seed(t + h + gpt_oss)
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)

    def mxfp4(n, k):
        blocks = torch.randint(0, 256, (experts, n, k // 32, 16), device=device, generator=gen,
                               dtype=torch.uint8)
        # values of RMS about 3, so a row's sum is about 1 for exponents near 1 / (3 sqrt(k))
        exponent = 127 - round(math.log2(3 * k ** 0.5)) + torch.randint(
            -2, 2, (experts, n, k // 32), device=device, generator=gen)
        return mxfp4_words(blocks, exponent.to(torch.uint8))

    (w13, s13), (w2, s2) = mxfp4(2 * inter, h), mxfp4(h, inter)
    extra = {}
    if gpt_oss:
        extra = dict(w13_bias=torch.randn(experts, 2 * inter, device=device,
                                          generator=gen).bfloat16(),
                     w2_bias=torch.randn(experts, h, device=device, generator=gen).bfloat16(),
                     swiglu=(1.702, 0.7))
    weights, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, True,
                         torch.bfloat16, softmax_after_topk=gpt_oss)
    want = fused_moe_ref(x.float(), w13, w2, weights.float(), ids, s13, s2,
                         **_floats(extra), fp4=True)
    got = fused_moe(x, w13, w2, weights, ids, None, s13, s2, **extra, fp4=True)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.interpreter
def test_mxfp4_scale_bytes_decode_exactly(device):
    """The tiles' 2^(s - 127) from each e8m0 byte, read back through the gate/up GEMM with
    one-hot rows of x (token k of expert e gives W[e][:, k]): random codes at scale bytes 0 and
    1 (subnormal weights), 127, and 254 and 255 (2^128) with the codes whose weights are finite
    (|e2m1| <= 1.5 and <= 0.5: one inf would make its column's dot NaN), equal to the reference's
    dequantization and to transformers' (dequantize_mxfp4)."""
    from conveyor.kernels.fused_moe import _gemm, _tiles, dequantize_experts
    from conveyor.worker.mxfp4_checkpoint import dequantize_mxfp4, mxfp4_words

    gen = torch.Generator(device=device).manual_seed(11)
    experts, n, k = 2, 40, 64
    scales = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8, device=device)[
        torch.randint(0, 5, (experts, n, k // 32), device=device, generator=gen)]
    codes = torch.randint(0, 16, (experts, n, k // 32, 32), device=device, generator=gen)
    most = torch.where(scales == 255, 1, torch.where(scales == 254, 3, 7))[..., None]
    codes = torch.where((codes & 7) > most, codes & 8, codes)       # too large: a signed 0
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    words, scales = mxfp4_words(blocks, scales)
    want = dequantize_experts(words, scales, None, torch.bfloat16, fp4=True)    # [E, N, K]
    assert torch.equal(want, dequantize_mxfp4(blocks, scales, torch.bfloat16))
    assert want.isfinite().all() and (want.abs() == 2.0 ** 127).any()
    assert (want[want != 0].abs() < 2.0 ** -126).any()                  # subnormal weights

    x = torch.eye(k, device=device, dtype=torch.bfloat16).repeat(experts, 1)   # [E K, K]
    ids = torch.arange(experts, device=device, dtype=torch.int32).repeat_interleave(k)[:, None]
    tiles = _tiles(experts * k, experts)
    sorted_ids, expert_ids, total = align(ids, experts, tiles[0])
    got = torch.empty(experts * k, n, dtype=torch.bfloat16, device=device)
    _gemm(x, words, scales, None, None, got, torch.ones(experts * k, device=device), sorted_ids,
          expert_ids, total, experts * k, 1, False, tiles, fp4=True)
    assert torch.equal(got.view(experts, k, n), want.transpose(1, 2))


@pytest.mark.interpreter
@pytest.mark.parametrize("t,experts,top_k,block_m", [(1, 8, 2, 16), (37, 5, 3, 16),
                                                     (300, 64, 8, 64), (9, 128, 1, 4),
                                                     (700, 3, 2, 128), (2, 200, 1, 32)])
def test_align_sorts_and_pads_per_expert(t, experts, top_k, block_m, device):
    """Every pair once, in a tile of its expert, padding marked, the padded total right; with
    pairs over two counting blocks (700 x 2), tiles over two rounds of the offsets kernel's loop
    (300 x 8) and an expert count short of a power of two (200)."""
    gen = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)]).int()
    sorted_ids, expert_ids, total = (v.cpu() for v in align(ids.to(device), experts, block_m))
    n = t * top_k
    flat = ids.reshape(-1)
    assert sorted_ids.shape[0] % block_m == 0 and int(total) <= sorted_ids.shape[0]
    assert int(total) % block_m == 0
    real = sorted_ids[:int(total)]
    assert sorted(real[real < n].tolist()) == list(range(n))      # every pair once
    assert (sorted_ids[int(total):] == n).all()
    for tile in range(int(total) // block_m):
        pairs = sorted_ids[tile * block_m:(tile + 1) * block_m]
        pairs = pairs[pairs < n].long()
        assert len(pairs) > 0 and (flat[pairs] == expert_ids[tile]).all()
    counts = torch.bincount(flat.long(), minlength=experts)
    assert int(total) == int(((counts + block_m - 1) // block_m * block_m).sum())
