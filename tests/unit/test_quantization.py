"""Weight quantization without a GPU: round-trip error bounds, --keep-precision matching, the
layer report, GGUF Q8_0 blocks, the quantized linear/embedding forward against dequantized
float weights, and the options' validation and CLI flags."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models_util import make_tiny_model

from conveyor.cli import build_parser, engine_kwargs
from conveyor.kernels.dequantize import dequantize_ref
from conveyor.shared.config import EngineConfig
from conveyor.shared.model_files import read_model_config, resolve_model
from conveyor.worker.gguf_tensors import q8_0_blocks
from conveyor.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from conveyor.worker.layers.linear import RowParallelLinear, default_weight_loader, linear
from conveyor.worker.layers.quantization import (
    FP8_MAX,
    keep_matches,
    quantize_model,
    quantize_weight,
)
from conveyor.worker.loader import load_model

KEEP = EngineConfig().keep_patterns


def weights(n=37, k=300, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]   # rows of any size
    w[3] = 0.0                                                                 # an all-zero row
    return w


def test_int8_round_trip_is_within_half_a_step():
    w = weights()
    q, scale = quantize_weight(w, "int8")
    assert q.dtype == torch.int8 and scale.shape == (w.shape[0], 1)
    assert q.abs().max() <= 127 and (q.abs().amax(1)[scale[:, 0] != 1] == 127).all()
    err = (w - dequantize_ref(q, scale, torch.float32)).abs()
    assert (err <= scale / 2 * (1 + 1e-6)).all()
    assert (dequantize_ref(q, scale, torch.float32)[3] == 0).all()


def test_fp8_round_trip_is_within_e4m3_rounding():
    """e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most 2^-4 of the value for
    normal numbers; below the smallest normal (2^-6 of the scale) by half a subnormal step."""
    w = weights()
    q, scale = quantize_weight(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], 1)
    assert torch.allclose(q.float().abs().amax(1)[scale[:, 0] != 1], torch.tensor(FP8_MAX))
    err = (w - dequantize_ref(q, scale, torch.float32)).abs()
    bound = torch.maximum(w.abs() * 2 ** -4, scale * 2 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()
    rel = err.sum() / w.abs().sum()
    assert rel < 0.03


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="mode"):
        quantize_weight(torch.ones(2, 2), "int4")
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_weight(torch.ones(2), "int8")


def test_group_scales_dequantize_per_block():
    q = torch.randint(-127, 128, (4, 64), dtype=torch.int8)
    scale = torch.rand(4, 2)
    want = torch.cat([q[:, :32].float() * scale[:, :1], q[:, 32:].float() * scale[:, 1:]], 1)
    torch.testing.assert_close(dequantize_ref(q, scale, torch.float32), want)


def test_q8_0_blocks_are_what_gguf_dequantizes_to():
    import gguf

    w = weights(n=6, k=96).numpy()
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    q, scale = q8_0_blocks(data)
    assert q.shape == (6, 96) and q.dtype == torch.int8 and scale.shape == (6, 3)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
    torch.testing.assert_close(dequantize_ref(q, scale, torch.float32), torch.from_numpy(ref),
                               rtol=0, atol=0)


@pytest.mark.parametrize("name,kept", [
    ("lm_head", True), ("model.embed_tokens", True), ("model.layers.3.mlp.down_proj", False),
    ("model.layers.0.self_attn.qkv_proj", False)])
def test_default_keep_precision(name, kept):
    assert keep_matches(name, KEEP) == kept


def test_keep_precision_patterns():
    keep = EngineConfig(keep_precision=r"lm_head, layers\.(0|1)\.").keep_patterns
    assert keep_matches("model.layers.1.mlp.down_proj", keep)
    assert not keep_matches("model.layers.11.mlp.down_proj", keep)
    assert keep_matches("lm_head", keep)
    assert EngineConfig(keep_precision="").keep_patterns == ()


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantization="int4"), "quantization"),
    (dict(quantization="INT8"), "quantization"),
    (dict(keep_precision="lm_head,(unclosed"), "keep_precision"),
])
def test_invalid_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_cli_flags():
    args = build_parser().parse_args(["generate", "hi", "--quantization", "int8",
                                      "--keep-precision", "lm_head"])
    kw = engine_kwargs(args)
    assert kw["quantization"] == "int8" and kw["keep_precision"] == "lm_head"
    assert EngineConfig.from_kwargs(**kw).quantization == "int8"
    defaults = engine_kwargs(build_parser().parse_args(["generate", "hi"]))
    assert defaults["quantization"] is None
    assert defaults["keep_precision"] == "lm_head,embed_tokens"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return resolve_model(str(make_tiny_model("llama-tied", tmp_path_factory.mktemp("tied"))))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_report_names_every_layer_and_ties_quantize_once(tiny_files, mode):
    cfg = read_model_config(tiny_files)
    model = load_model(cfg, tiny_files, torch.float32, "cpu", mode, KEEP)
    report = model.quant_report
    layers = [f"model.layers.{i}.{m}" for i in range(cfg.num_hidden_layers)
              for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                        "mlp.down_proj")]
    assert report.quantized == layers
    assert report.kept == ["model.embed_tokens", "lm_head"] and report.prequantized == []
    assert report.bytes_after < report.bytes_before / 3
    assert f"{mode}: quantized {len(layers)} layers" in report.summary()
    assert "kept in float32: model.embed_tokens, lm_head" in report.summary()
    assert model.lm_head.weight is model.model.embed_tokens.weight     # still tied, float32
    assert model.model.layers[0].mlp.down_proj.weight.dtype == _DTYPE[mode]

    everything = load_model(cfg, tiny_files, torch.float32, "cpu", mode, ()).quant_report
    assert everything.kept == [] and len(everything.quantized) == len(layers) + 2
    embed_bytes = cfg.vocab_size * cfg.hidden_size * 4       # counted once, quantized once
    assert everything.bytes_before == report.bytes_before + embed_bytes
    assert load_model(cfg, tiny_files, torch.float32, "cpu").quant_report is None


_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_layers_compute_with_their_dequantized_weights(mode):
    """The CPU path of a quantized row-parallel layer (fused SiLU-and-mul input, bias), the LM
    head and the embedding: float math on the dequantized weights (fp8: with x rounded to fp8
    per token, as on the GPU)."""
    torch.manual_seed(0)
    down = RowParallelLinear(48, 24, bias=True)
    default_weight_loader(down.weight, torch.randn(24, 48))
    default_weight_loader(down.bias, torch.randn(24))
    head = ParallelLMHead(50, 24)
    head.weight_loader(head.weight, torch.randn(50, 24))
    embed = VocabParallelEmbedding(50, 24)
    embed.weight_loader(embed.weight, torch.randn(50, 24))
    model = torch.nn.ModuleDict({"down": down, "head": head, "embed": embed})
    ref = {k: m.weight.detach().clone() for k, m in model.items()}
    report = quantize_model(model, mode, (), "cpu")
    assert sorted(report.quantized) == ["down", "embed", "head"]
    deq = {k: dequantize_ref(m.weight, m.weight_scale, torch.float32) for k, m in model.items()}
    for k in deq:
        assert (deq[k] - ref[k]).abs().max() <= ref[k].abs().max() * 0.07

    x = torch.randn(5, 96)
    act = F.silu(x[:, :48]) * x[:, 48:]
    if mode == "fp8":
        from conveyor.kernels.quant_fp8 import quant_fp8_ref

        q, s = quant_fp8_ref(act)
        act = q.float() * s
    torch.testing.assert_close(down(x, silu_mul=True), F.linear(act, deq["down"], down.bias))
    h = torch.randn(3, 24)
    if mode == "fp8":
        from conveyor.kernels.quant_fp8 import quant_fp8_ref

        q, s = quant_fp8_ref(h)
        h_in = q.float() * s
    else:
        h_in = h
    torch.testing.assert_close(head(h), h_in @ deq["head"].T)
    ids = torch.tensor([0, 7, 49, 7])
    torch.testing.assert_close(embed(ids), deq["embed"][ids])


def test_linear_without_scale_is_f_linear():
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))


def test_int8_parameters_load_only_int8():
    layer = RowParallelLinear(64, 8)
    layer.make_quantized(torch.int8, 2)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (8, 2)
    with pytest.raises(ValueError, match="dtype mismatch"):
        layer.weight.weight_loader(layer.weight, torch.randn(8, 64))
    layer.weight.weight_loader(layer.weight, torch.ones(8, 64, dtype=torch.int8))
    layer.weight_scale.weight_loader(layer.weight_scale, torch.full((8, 2), 0.5))
    torch.testing.assert_close(layer(torch.ones(1, 64)), torch.full((1, 8), 32.0))


def test_fp8_rows_are_not_asked_for_on_the_cpu():
    layer = RowParallelLinear(64, 32)
    quantize_model(layer, "fp8", (), "cpu")
    assert not layer.takes_fp8_rows(torch.randn(4, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 tensor cores")
def test_norm_and_mlp_hand_over_fp8_rows_with_unfused_results():
    """An fp8 MLP on the GPU as the decoder layer runs it: the norm quantizes for gate_up when
    gate_up.takes_fp8_rows (more than one row), the down projection's quantization applies
    SiLU-and-mul; the outputs equal the unfused kernels' (norm, then quant_fp8) to the bit."""
    from conveyor.kernels.fp8_gemm import supported
    from conveyor.worker.layers.linear import MergedColumnParallelLinear
    from conveyor.worker.layers.norm import RMSNorm

    if not supported(torch.device("cuda")):
        pytest.skip("needs compute capability 8.9+")
    torch.manual_seed(0)
    dt = torch.bfloat16
    norm = RMSNorm(256, 1e-6, dt).cuda()
    norm.weight.data.normal_()
    gate_up = MergedColumnParallelLinear(256, [512, 512], dtype=dt)
    down = RowParallelLinear(512, 256, dtype=dt)
    for layer in (gate_up, down):
        layer.weight.data.normal_(std=256 ** -0.5)
        quantize_model(layer, "fp8", (), "cuda")
    for rows in (1, 9):
        x, res = torch.randn(rows, 256, device="cuda", dtype=dt), torch.randn(
            rows, 256, device="cuda", dtype=dt)
        fp8 = gate_up.takes_fp8_rows(x)
        assert fp8 == (rows > 1)
        h, r = norm(x, res, fp8=fp8)
        h_ref, r_ref = norm(x, res)
        assert torch.equal(r, r_ref)
        assert torch.equal(down(gate_up(h), silu_mul=True),
                           down(gate_up(h_ref), silu_mul=True))
    bf16 = RowParallelLinear(256, 64, dtype=dt).cuda()
    assert not bf16.takes_fp8_rows(x)
