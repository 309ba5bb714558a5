"""The fused-MoE Triton path (align, two grouped GEMMs) against the torch reference, on odd
shapes: hidden and intermediate sizes off the tiles, experts with no tokens, decode-sized and
prefill-sized batches (each tile class: 1-8, 9-32 and more rows an expert), top-k 1, 2 and 8,
bf16 and fp16."""
import pytest
import torch

from conveyor.kernels.fused_moe import fused_moe, fused_moe_ref, route

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


def test_fused_moe_under_cuda_graph():
    """align and the kernels run without host syncs: captured once, replayed on new routing."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    t, h, inter, experts, top_k = 24, 128, 64, 8, 2
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, h, device="cuda", generator=gen) / 11).bfloat16()
    w2 = (torch.randn(experts, h, inter, device="cuda", generator=gen) / 8).bfloat16()
    logits = torch.randn(t, experts, device="cuda", generator=gen)
    weights, ids = route(logits, top_k, True, torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)                      # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    new_w, new_ids = route(torch.randn(t, experts, device="cuda", generator=gen), top_k, True,
                           torch.bfloat16)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.interpreter
@pytest.mark.parametrize("t,top_k", [(3, 2), (40, 3)])
def test_fused_moe_small(t, top_k, device):
    """Small shapes, also under Triton's interpreter on the CPU: the 16- and 32-row tiles
    chosen, and the prefill tiles."""
    gen = torch.Generator(device=device).manual_seed(t)
    h, inter, experts = 48, 40, 6
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, h, device=device, generator=gen) / 7).bfloat16()
    w2 = (torch.randn(experts, h, inter, device=device, generator=gen) / 6).bfloat16()
    weights, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, False,
                         torch.bfloat16)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    for tiles in (None, (128, 256, 64, 8, 4)):
        got = fused_moe(x, w13, w2, weights, ids, tiles)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


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
    s13, s2 = s13.view(experts, 2 * inter), s2.view(experts, h)
    weights, ids = route(torch.randn(t, experts, device=device, generator=gen), top_k, True,
                         torch.bfloat16)
    want = fused_moe_ref(x.float(), w13, w2, weights.float(), ids, s13, s2)
    got = fused_moe(x, w13, w2, weights, ids, None, s13, s2)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
