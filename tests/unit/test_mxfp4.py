"""gpt-oss's MXFP4 checkpoints (packed by tests/mxfp4_util.py, in the published layout): the
dequantization equals transformers' bit for bit, and so do the 4-bit words and scale bytes the
experts keep, dequantized by the fused-MoE reference; a tiny gpt-oss saved with MXFP4 experts
holds them in 4 bits and gives the greedy tokens of transformers loading the same checkpoint
dequantized."""
import pytest
import torch
from models_util import make_tiny_model
from mxfp4_util import make_mxfp4_gpt_oss, pack_mxfp4
from safetensors.torch import load_file, save_file

from conveyor.kernels._util import E2M1
from conveyor.kernels.fused_moe import dequantize_experts
from conveyor.worker.mxfp4_checkpoint import dequantize_mxfp4, mxfp4_words


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantization_equals_transformers_bit_for_bit(dtype):
    """Packed random weights (large, small, and all-zero blocks), and random bytes (every code
    and exponent, 255's 2^128 included), through ours and transformers'
    convert_moe_packed_tensors (which returns the transpose, transformers' [E, inputs, rows])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 10, 96, generator=gen) * torch.logspace(-6, 3, 10)[:, None]
    w[1, 2, 32:64] = 0
    packed = [pack_mxfp4(w),
              (torch.randint(0, 256, (2, 7, 5, 16), generator=gen, dtype=torch.uint8),
               torch.randint(0, 256, (2, 7, 5), generator=gen, dtype=torch.uint8))]
    for blocks, scales in packed:
        ours = dequantize_mxfp4(blocks, scales, dtype)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
        assert ours.shape == theirs.shape
        assert torch.equal(ours.view(bits), theirs.contiguous().view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_words_dequantize_to_the_same_bits(dtype):
    """The experts' 4-bit words and the scale bytes as they are (mxfp4_words), through the
    fused-MoE reference's dequantization, give dequantize_mxfp4's bits (so transformers'):
    every code at every scale byte (0 and 1: subnormal scales; 254 and 255: 2^127 and 2^128,
    whose products overflow to inf but for small codes), random bytes, and packed weights."""
    gen = torch.Generator().manual_seed(3)
    every = (torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 256, 16, 16),
             torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16))
    random = (torch.randint(0, 256, (3, 7, 5, 16), generator=gen, dtype=torch.uint8),
              torch.randint(0, 256, (3, 7, 5), generator=gen, dtype=torch.uint8))
    random[1][0, 0] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    w = torch.randn(2, 9, 64, generator=gen) * torch.logspace(-5, 2, 9)[:, None]
    for blocks, scales in (every, random, pack_mxfp4(w)):
        words, kept = mxfp4_words(blocks, scales)
        e, n, g = scales.shape
        assert words.dtype == torch.int32 and words.shape == (e, n, 4 * g)
        assert kept.dtype == torch.uint8 and torch.equal(kept, scales)
        ours = dequantize_experts(words, kept, None, dtype, fp4=True)
        bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
        assert torch.equal(ours.view(bits), dequantize_mxfp4(blocks, scales, dtype).view(bits))


def test_packer_round_trip():
    """Values already on the e2m1 grid times a block's power of two come back exactly; others
    within half the grid's widest gap (4 to 6: one block scale)."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 64), generator=gen)
    codes[:, ::32] = 7                                     # each block reaches 6 * 2^k
    exact = torch.tensor(E2M1)[codes] * torch.exp2(torch.randint(-8, 8, (4, 2), generator=gen)
                                                    .float()).repeat_interleave(32, 1)
    assert torch.equal(dequantize_mxfp4(*pack_mxfp4(exact), torch.float32), exact)
    w = torch.randn(4, 64, generator=gen)
    blocks, scales = pack_mxfp4(w)
    err = (dequantize_mxfp4(blocks, scales, torch.float32) - w).abs()
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, 1)
    assert (err <= step + 1e-6).all() and err.max() > 0


def test_mxfp4_model_matches_transformers(tmp_path):
    """Loaded from MXFP4 blocks and scales, the model keeps its experts in 4 bits (words, and
    the checkpoint's e8m0 scale bytes), which dequantize to the experts transformers
    dequantizes from the same checkpoint, exactly, and gives its greedy tokens (prefix caching
    and chunked prefill, as in test_models)."""
    from test_models import greedy, hf_greedy
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from conveyor.shared.model_files import read_model_config, resolve_model
    from conveyor.worker.loader import load_model

    src = make_tiny_model("gpt-oss", tmp_path / "src")
    make_mxfp4_gpt_oss(src, tmp_path / "mxfp4")
    files = resolve_model(str(tmp_path / "mxfp4"))
    config = read_model_config(files)
    assert config.quantization == "mxfp4"
    ours = load_model(config, files, torch.float32, "cpu", quantization="mxfp4")
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", dtype=torch.float32,
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    experts = ref.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)             # [E, 2I, H]
    moe = ours.model.layers[1].mlp.experts
    e, two_i, h = gate_up.shape
    assert moe.fp4 and moe.w13_zero is None
    assert moe.w13.dtype == moe.w2.dtype == torch.int32                 # 8 codes a word
    assert moe.w13.shape == (e, two_i, h // 8) and moe.w2.shape == (e, h, two_i // 16)
    assert moe.w13_scale.dtype == moe.w2_scale.dtype == torch.uint8     # one byte a block
    assert moe.w13_scale.shape == (e, two_i, h // 32) and moe.w2_scale.shape == (e, h, two_i // 64)
    checkpoint = load_file(tmp_path / "mxfp4" / "model.safetensors")
    scales = checkpoint["model.layers.1.mlp.experts.gate_up_proj_scales"]   # rows interleaved
    assert torch.equal(moe.w13_scale, torch.cat([scales[:, 0::2], scales[:, 1::2]], 1))
    w13 = dequantize_experts(moe.w13, moe.w13_scale, None, torch.float32, fp4=True)
    w2 = dequantize_experts(moe.w2, moe.w2_scale, None, torch.float32, fp4=True)
    assert torch.equal(w13, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1))
    assert torch.equal(w2, experts.down_proj.detach().transpose(1, 2))
    original = load_file(src / "model.safetensors")["model.layers.1.mlp.experts.down_proj"]
    assert not torch.equal(w2, original.transpose(1, 2))                # it was quantized
    report = ours.quant_report
    assert report.mode == "mxfp4" and report.from_checkpoint and not report.quantized
    assert report.prequantized == [f"model.layers.{i}.mlp.experts"
                                   for i in range(config.num_hidden_layers)]
    assert "model.layers.0.self_attn.qkv_proj" in report.kept
    # each layer's experts: 4-bit words and a scale byte a block of 32
    values = config.num_hidden_layers * e * 3 * two_i // 2 * h
    assert report.bytes_after == values // 2 + values // 32

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, config.vocab_size, (41,), generator=gen).tolist()
               for _ in range(3)]
    eos = config.eos_token_ids[0]
    got = [t[:t.index(eos) + 1] if eos in t else t for t in greedy(ours, prompts, 12)]
    assert got == hf_greedy(ref, prompts, 12)


def test_unpaired_blocks_are_refused(tmp_path):
    from conveyor.shared.model_files import read_model_config, resolve_model
    from conveyor.worker.loader import load_model

    src = make_tiny_model("gpt-oss", tmp_path / "src", num_hidden_layers=2)
    make_mxfp4_gpt_oss(src, tmp_path / "mxfp4")
    path = tmp_path / "mxfp4" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, path)
    files = resolve_model(str(tmp_path / "mxfp4"))
    with pytest.raises(ValueError, match="down_proj"):
        load_model(read_model_config(files), files, torch.float32, "cpu")


def _experts(monkeypatch, inter: int, rank: int, size: int):
    """gpt-oss-like experts (4 of H = 64 inputs, biases, the clamped SwiGLU) of intermediate
    size `inter`, as rank `rank` of `size` builds them."""
    from conveyor.worker.layers import moe

    monkeypatch.setattr(moe, "tp_rank", lambda: rank)
    monkeypatch.setattr(moe, "tp_size", lambda: size)
    return moe.FusedMoE(4, 2, 64, inter, True, torch.float32, bias=True, swiglu=(1.702, 1.0),
                        softmax_after_topk=True)


def test_tensor_parallel_ranks_take_whole_blocks(monkeypatch):
    """Two ranks' MXFP4 experts (an intermediate size of 64: one block of 32 a rank) take
    their rows of gate/up's words and scales and their columns of down's, and their partial
    sums add up to the unsharded layer's, which is the reference on the dequantized weights.
    Where a rank's share is not whole blocks (96 over two ranks: 48) the loader leaves the
    experts in the model dtype, to be dequantized as they load."""
    from conveyor.kernels.fused_moe import fused_moe_ref
    from conveyor.worker.layers.router import route
    from conveyor.worker.loader import _take_mxfp4

    gen = torch.Generator().manual_seed(4)
    h, inter, experts = 64, 64, 4
    parts = {(e, p): torch.randn(h if p == 2 else inter, inter if p == 2 else h, generator=gen)
             for e in range(experts) for p in range(3)}
    bias = {(e, p): torch.randn(h if p == 2 else inter, generator=gen)
            for e in range(experts) for p in range(3)}
    packed = {key: mxfp4_words(*pack_mxfp4(w)) for key, w in parts.items()}

    def build(rank, size):
        layer = _experts(monkeypatch, inter, rank, size)
        assert _take_mxfp4(torch.nn.ModuleDict({"experts": layer})) and layer.fp4
        for (e, p), (words, scales) in packed.items():
            layer.weight_loader(layer.w2 if p == 2 else layer.w13, words, (e, p))
            layer.weight_loader(layer.w2_scale if p == 2 else layer.w13_scale, scales, (e, p))
            layer.weight_loader(layer.w2_bias if p == 2 else layer.w13_bias, bias[e, p], (e, p))
        return layer

    x, logits = torch.randn(5, h, generator=gen), torch.randn(5, experts, generator=gen)
    whole = build(0, 1)(x, logits)
    halves = build(0, 2)(x, logits) + build(1, 2)(x, logits)
    torch.testing.assert_close(halves, whole, atol=1e-5, rtol=1e-5)
    dequantized = {key: dequantize_mxfp4(*pack_mxfp4(w), torch.float32)
                   for key, w in parts.items()}
    w13 = torch.stack([torch.cat([dequantized[e, 0], dequantized[e, 1]])
                       for e in range(experts)])
    w2 = torch.stack([dequantized[e, 2] for e in range(experts)])
    weights, ids = route(logits, 2, True, torch.float32, softmax_after_topk=True)
    want = fused_moe_ref(x, w13, w2, weights, ids, w13_bias=torch.stack(
        [torch.cat([bias[e, 0], bias[e, 1]]) for e in range(experts)]), w2_bias=torch.stack(
        [bias[e, 2] for e in range(experts)]), swiglu=(1.702, 1.0))
    torch.testing.assert_close(whole, want)

    split = _experts(monkeypatch, 96, 0, 2)
    assert not _take_mxfp4(torch.nn.ModuleDict({"experts": split}))
    assert not split.fp4 and split.w13.dtype == torch.float32


def test_dummy_weights_draw_mxfp4_experts(tmp_path):
    """load_format=dummy with gpt-oss's MXFP4 config.json: the experts hold random 4-bit
    words and scale bytes, the rest is drawn in full precision and kept so, and it runs."""
    import json

    from test_models import greedy

    from conveyor.shared.model_files import read_model_config, resolve_model
    from conveyor.worker.loader import load_model

    path = make_tiny_model("gpt-oss", tmp_path / "config-only", weights=False)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    files = resolve_model(str(path))
    model = load_model(read_model_config(files), files, torch.float32, "cpu", "mxfp4",
                       load_format="dummy", seed=5)
    moe = model.model.layers[0].mlp.experts
    assert moe.fp4 and moe.w13.dtype == torch.int32 and moe.w2_scale.dtype == torch.uint8
    assert len(model.quant_report.prequantized) == config["num_hidden_layers"]
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert len(greedy(model, [[3, 4, 5]], 4)[0]) == 4


def test_another_quantization_is_refused():
    """As with AWQ and GPTQ checkpoints: --quantization int8 or fp8 over MXFP4 experts is an
    error, not a second quantization."""
    from conveyor.worker.layers.quantization import resolve_mode

    assert resolve_mode(None, "mxfp4") == "mxfp4"
    with pytest.raises(ValueError, match="already quantized"):
        resolve_mode("fp8", "mxfp4")
