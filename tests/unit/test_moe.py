"""The MoE pieces that run on the CPU: routing and tensor-parallel sharding of the experts'
intermediate dimension. (The fused kernels' per-expert sort, `align`, is tested with them in
tests/kernels/test_fused_moe.py.)"""
import pytest
import torch

from conveyor.kernels.fused_moe import fused_moe_ref, route
from conveyor.worker.layers import moe


def test_route_renormalises_where_asked():
    logits = torch.randn(6, 9)
    w, ids = route(logits, 3, True, torch.float32)
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    w2, ids2 = route(logits, 3, False, torch.float32)
    assert torch.equal(ids, ids2) and (w2.sum(-1) < 1).all()
    assert torch.equal(ids.long(), logits.topk(3).indices)


def test_tensor_parallel_shards_sum_to_the_whole(monkeypatch):
    """Two ranks' experts, each with half of every expert's intermediate dimension, give
    partial sums that add up to the unsharded layer's output."""
    gen = torch.Generator().manual_seed(0)
    experts, h, inter, top_k = 4, 16, 12, 2
    full = {(e, p): torch.randn(h if p == 2 else inter, inter if p == 2 else h, generator=gen)
            for e in range(experts) for p in range(3)}

    def build(rank, size):
        monkeypatch.setattr(moe, "tp_rank", lambda: rank)
        monkeypatch.setattr(moe, "tp_size", lambda: size)
        layer = moe.FusedMoE(experts, top_k, h, inter, True, torch.float32)
        for (e, p), w in full.items():
            layer.weight_loader(layer.w2 if p == 2 else layer.w13, w, (e, p))
        return layer

    x, logits = torch.randn(5, h, generator=gen), torch.randn(5, experts, generator=gen)
    whole = build(0, 1)(x, logits)
    parts = build(0, 2)(x, logits) + build(1, 2)(x, logits)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    w, ids = route(logits, top_k, True, torch.float32)
    w13 = torch.stack([torch.cat([full[e, 0], full[e, 1]]) for e in range(experts)])
    w2 = torch.stack([full[e, 2] for e in range(experts)])
    torch.testing.assert_close(whole, fused_moe_ref(x, w13, w2, w, ids))


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
