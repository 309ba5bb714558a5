"""The MoE pieces that run on the CPU: routing (softmax, and GLM's grouped sigmoid router)
and tensor-parallel sharding of the experts'
intermediate dimension, and gpt-oss's options (router and expert biases, a softmax over the top
K, the clamped SwiGLU) against transformers' GptOssMLP. (The fused kernels' per-expert sort,
`align`, is tested with them in tests/kernels/test_fused_moe.py.)"""
import pytest
import torch

from conveyor.kernels.fused_moe import fused_moe_ref
from conveyor.worker.layers import moe
from conveyor.worker.layers.router import route


def test_route_renormalises_where_asked():
    logits = torch.randn(6, 9)
    w, ids = route(logits, 3, True, torch.float32)
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    w2, ids2 = route(logits, 3, False, torch.float32)
    assert torch.equal(ids, ids2) and (w2.sum(-1) < 1).all()
    assert torch.equal(ids.long(), logits.topk(3).indices)


def test_route_softmax_after_topk_is_transformers_router():
    """gpt-oss's router: the top K logits, then a softmax over them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = GptOssConfig(hidden_size=16, num_local_experts=7, num_experts_per_tok=3)
    router = GptOssTopKRouter(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(7, 16, generator=gen))
        router.bias.copy_(torch.randn(7, generator=gen))
        logits, want_w, want_ids = router(torch.randn(9, 16, generator=gen))
    w, ids = route(logits, 3, True, torch.float32, softmax_after_topk=True)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w)


@pytest.mark.parametrize("experts,top_k,groups,chosen,norm,scale", [
    (8, 2, 1, 1, True, 1.0), (16, 4, 4, 2, True, 2.5), (12, 3, 3, 3, False, 1.5),
    (10, 1, 5, 1, True, 1.0)])
def test_grouped_router_is_transformers_glm_router(experts, top_k, groups, chosen, norm,
                                                   scale):
    """DeepSeek-V3's grouped sigmoid router as GLM-4.5 runs it: the same experts (the order
    within a token aside) and weights as transformers' Glm4MoeTopkRouter."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from conveyor.worker.layers.router import GroupedTopKRouter

    config = Glm4MoeConfig(hidden_size=16, n_routed_experts=experts, num_experts_per_tok=top_k,
                           n_group=groups, topk_group=chosen, norm_topk_prob=norm,
                           routed_scaling_factor=scale)
    ref = Glm4MoeTopkRouter(config)
    ours = GroupedTopKRouter(experts, 16, top_k, groups, chosen, norm, scale)
    gen = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        for router in (ref, ours):
            router.weight.copy_(torch.randn(experts, 16, generator=gen.manual_seed(1)))
            router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.5)
        x = torch.randn(33, 16, generator=gen)
        _, want_w, want_ids = ref(x)
        w, ids = ours(x)
    order, want_order = ids.long().sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices))


GPT_OSS = dict(bias=True, swiglu=(1.702, 0.9), softmax_after_topk=True)


@pytest.mark.parametrize("options", [{}, GPT_OSS], ids=["plain", "gpt-oss"])
def test_tensor_parallel_shards_sum_to_the_whole(monkeypatch, options):
    """Two ranks' experts, each with half of every expert's intermediate dimension (and of the
    gate/up biases; the down bias added on rank 0 only), give partial sums that add up to the
    unsharded layer's output."""
    gen = torch.Generator().manual_seed(0)
    experts, h, inter, top_k = 4, 16, 12, 2
    full = {(e, p): torch.randn(h if p == 2 else inter, inter if p == 2 else h, generator=gen)
            for e in range(experts) for p in range(3)}
    bias = {(e, p): torch.randn(h if p == 2 else inter, generator=gen)
            for e in range(experts) for p in range(3)}

    def build(rank, size):
        monkeypatch.setattr(moe, "tp_rank", lambda: rank)
        monkeypatch.setattr(moe, "tp_size", lambda: size)
        layer = moe.FusedMoE(experts, top_k, h, inter, True, torch.float32, **options)
        for (e, p), w in full.items():
            layer.weight_loader(layer.w2 if p == 2 else layer.w13, w, (e, p))
            if options:
                layer.weight_loader(layer.w2_bias if p == 2 else layer.w13_bias, bias[e, p],
                                    (e, p))
        return layer

    x, logits = torch.randn(5, h, generator=gen), torch.randn(5, experts, generator=gen)
    whole = build(0, 1)(x, logits)
    parts = build(0, 2)(x, logits) + build(1, 2)(x, logits)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    w, ids = route(logits, top_k, True, torch.float32, bool(options))
    w13 = torch.stack([torch.cat([full[e, 0], full[e, 1]]) for e in range(experts)])
    w2 = torch.stack([full[e, 2] for e in range(experts)])
    extra = {}
    if options:
        extra = dict(w13_bias=torch.stack([torch.cat([bias[e, 0], bias[e, 1]])
                                           for e in range(experts)]),
                     w2_bias=torch.stack([bias[e, 2] for e in range(experts)]),
                     swiglu=options["swiglu"])
    torch.testing.assert_close(whole, fused_moe_ref(x, w13, w2, w, ids, **extra))


def test_gpt_oss_block_matches_transformers():
    """SparseMoeBlock with gpt-oss's options against transformers' GptOssMLP (router and
    experts with random biases, interleaved gate/up de-interleaved into w13), with a limit
    low enough that the clamps act."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    h, inter, experts = 32, 24, 5
    config = GptOssConfig(hidden_size=h, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=2, swiglu_limit=0.8)
    ref = GptOssMLP(config).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ours = moe.SparseMoeBlock(experts, 2, h, inter, True, torch.float32, bias=True,
                              swiglu=(1.702, 0.8), softmax_after_topk=True)
    gate_up = ref.experts.gate_up_proj.detach().transpose(1, 2)           # [E, 2I, H]
    with torch.no_grad():
        ours.gate.weight.copy_(ref.router.weight)
        ours.gate.bias.copy_(ref.router.bias)
        ours.experts.w13.copy_(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1))
        ours.experts.w2.copy_(ref.experts.down_proj.transpose(1, 2))
        b = ref.experts.gate_up_proj_bias
        ours.experts.w13_bias.copy_(torch.cat([b[:, 0::2], b[:, 1::2]], 1))
        ours.experts.w2_bias.copy_(ref.experts.down_proj_bias)
        x = torch.randn(11, h, generator=gen) * 2
        want = ref(x[None])[0][0]
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_experts_stay_close(mode):
    """--quantization int8 / fp8 quantizes each expert's rows; the layer's output stays within
    the quantization's error of the full-precision one (and the scales are used: off by the
    scale otherwise)."""
    gen = torch.Generator().manual_seed(1)
    layer = moe.FusedMoE(6, 2, 32, 24, True, torch.float32)
    layer.w13.data = torch.randn(6, 48, 32, generator=gen) / 6
    layer.w2.data = torch.randn(6, 32, 24, generator=gen) / 5
    x, logits = torch.randn(9, 32, generator=gen), torch.randn(9, 6, generator=gen)
    full = layer(x, logits)
    before, after = layer.quantize(mode, torch.device("cpu"))
    assert layer.w13.dtype == (torch.int8 if mode == "int8" else torch.float8_e4m3fn)
    assert layer.w13_scale.shape == (6, 48, 1) and after < before / 3
    err = (layer(x, logits) - full).abs().max() / full.abs().max()
    assert err < (0.02 if mode == "int8" else 0.08)


def test_quantized_moe_model_reports_its_experts(tmp_path):
    """--quantization int8 on a tiny Qwen3-MoE: the experts are quantized (the report names
    them; the router stays in precision), and with the other projections kept the logits stay
    close to the unquantized model's. (Quantizing this random model's attention too moves a
    router's choice for some tokens: a different expert, a large change, not an error.)"""
    from models_util import make_tiny_model
    from test_models import pool_for, run_step

    from conveyor.shared.model_files import read_model_config, resolve_model
    from conveyor.worker.loader import load_model

    files = resolve_model(str(make_tiny_model("qwen3-moe", tmp_path / "m")))
    config = read_model_config(files)
    full = load_model(config, files, torch.float32, "cpu")
    quant = load_model(config, files, torch.float32, "cpu", quantization="int8",
                       keep=(__import__("re").compile("lm_head|embed_tokens|proj"),))
    report = quant.quant_report
    assert report.quantized == [f"model.layers.{i}.mlp.experts" for i in (0, 2)]
    assert "model.layers.0.mlp.gate" in report.kept
    assert "model.layers.1.mlp.gate_up_proj" in report.kept                 # the dense layer
    prompt = list(range(10, 30))
    a = run_step(full, pool_for(full), {0: prompt}, [(0, 20)], 0)[0]
    b = run_step(quant, pool_for(quant), {0: prompt}, [(0, 20)], 0)[0]
    assert (a - b).abs().max() < 0.05 * a.abs().max()
