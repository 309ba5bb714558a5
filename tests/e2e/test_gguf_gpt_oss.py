"""GGUF files of gpt-oss as llama.cpp's converter writes them (tests/models_util.py,
make_tiny_gpt_oss_gguf): conveyor's greedy tokens and top-5 logprobs equal transformers' on the
weights the file holds (dequantized by gguf), with experts in MXFP4 (kept in 4 bits) or Q8_0
(kept in int8 with --quantization int8); the MXFP4 experts stay the file's codes and e8m0 bytes,
which decode to gguf's values; the converter's repacking of the published checkpoint's blocks is
undone bit for bit; and the config keys llama.cpp fixes or defaults, filled in as it does."""
import gguf
import numpy as np
import pytest
import torch
from models_util import make_tiny_gpt_oss_gguf
from test_gguf_families import kept_int8, run_the_file

from conveyor.kernels.fused_moe import dequantize_experts
from conveyor.shared.model_config import ModelConfig
from conveyor.shared.model_files import gguf_to_hf_config, read_model_config, resolve_model
from conveyor.worker import loader
from conveyor.worker.gguf_tensors import mxfp4_blocks
from conveyor.worker.mxfp4_checkpoint import dequantize_mxfp4

MXFP4 = gguf.GGMLQuantizationType.MXFP4
# what llama.cpp's gpt-oss GGUF can hold: its SwiGLU limit is fixed at 7 (the preset's is 1.5)
CARRIED = {"swiglu_limit": 7.0}


@pytest.mark.parametrize("quant, experts", [("F16", "MXFP4"), ("Q8_0", "MXFP4"),
                                            ("Q8_0", "Q8_0")])
def test_gguf_gpt_oss_matches_transformers(tmp_path, quant, experts):

    path = make_tiny_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", tmp_path / "ref", quant, experts,
                                  **CARRIED)
    llm, outs = run_the_file(path, tmp_path / "ref")
    assert llm.runner.model.model.layers[0].mlp.experts.fp4 == (experts == "MXFP4")
    if experts != "Q8_0":
        return
    int8 = kept_int8(path, outs)
    layers = int8.runner.model_config.num_hidden_layers
    assert len(int8.quantization_report.prequantized) == 3 * layers   # qkv, o, experts
    moe = int8.runner.model.model.layers[0].mlp.experts
    assert moe.w13.dtype == torch.int8 and moe.w13_scale.shape[2] == 64 // 32


def test_gguf_mxfp4_experts_stay_the_files_bytes(tmp_path, monkeypatch):
    """Loaded from the GGUF, every layer's experts are int32 words and the file's own e8m0
    bytes, which dequantize to gguf's values (equal bits, but for the sign of code 8's zero:
    e2m1's -0, ggml's +0); where the experts cannot take MXFP4 (a rank's share not whole
    blocks), the same values load dequantized."""
    path = make_tiny_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", tmp_path / "ref", **CARRIED)
    files = resolve_model(str(path))
    config = read_model_config(files)
    assert config.quantization == "mxfp4"
    reader = gguf.GGUFReader(path)
    stacks = {t.name: t for t in reader.tensors if t.tensor_type == MXFP4}

    def held(i, *projections):          # what the file holds: values and scale bytes
        ts = [stacks[f"blk.{i}.ffn_{p}_exps.weight"] for p in projections]
        values = torch.cat([torch.from_numpy(gguf.quants.dequantize(t.data, MXFP4)) for t in ts],
                           1)
        scales = torch.cat([torch.from_numpy(t.data.reshape(*t.data.shape[:2], -1, 17)[..., 0]
                                             .copy()) for t in ts], 1)
        return values, scales

    def bits(w):
        return (w + 0.0).view(torch.int32)          # -0 + 0 = +0

    model = loader.load_model(config, files, torch.float32, "cpu", "mxfp4")
    for i, layer in enumerate(model.model.layers):
        moe = layer.mlp.experts
        assert moe.fp4 and moe.w13.dtype == moe.w2.dtype == torch.int32
        assert moe.w13_scale.dtype == moe.w2_scale.dtype == torch.uint8
        for w, scale, projections in ((moe.w13, moe.w13_scale, ("gate", "up")),
                                      (moe.w2, moe.w2_scale, ("down",))):
            values, scales = held(i, *projections)
            assert torch.equal(scale, scales)
            ours = dequantize_experts(w, scale, None, torch.float32, fp4=True)
            assert torch.equal(bits(ours), bits(values))
    report = model.quant_report
    assert report.mode == "mxfp4" and not report.quantized
    assert report.prequantized == [f"model.layers.{i}.mlp.experts"
                                   for i in range(config.num_hidden_layers)]

    monkeypatch.setattr(loader, "_take_mxfp4", lambda model: False)
    dense = loader.load_model(config, files, torch.float32, "cpu", "mxfp4")
    moe = dense.model.layers[1].mlp.experts
    assert not moe.fp4 and moe.w13.dtype == torch.float32
    assert torch.equal(moe.w13, held(1, "gate", "up")[0])
    assert torch.equal(moe.w2, held(1, "down")[0])


def test_converter_repacking_is_undone_bit_for_bit():
    """llama.cpp's converter writes each of the published checkpoint's MXFP4 blocks (byte i:
    values 2i and 2i + 1) as its e8m0 byte and 16 bytes whose byte j holds values j and j + 16
    (transform_nibble_layout). gguf decodes such bytes to the checkpoint's values (every byte and
    code: infinities where 2^(s - 127) overflows, equal; zeros equal but for their sign), and
    mxfp4_blocks gives the checkpoint's blocks and scales back exactly."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 256, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(3, 256, 4)
    values = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-2)     # [..., G, 32]
    ggml = torch.cat([scales[..., None], values[..., :16] | (values[..., 16:] << 4)], -1)
    ggml = ggml.flatten(-2).numpy()                                         # [E, rows, G * 17]
    with np.errstate(over="ignore"):                # 2^128 times 2 and more: inf
        theirs = torch.from_numpy(gguf.quants.dequantize(ggml, MXFP4))
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal((ours + 0.0).view(torch.int32), (theirs + 0.0).view(torch.int32))
    back, back_scales = mxfp4_blocks(ggml)
    assert torch.equal(back, blocks) and torch.equal(back_scales, scales)


def _metadata(path, **rope_keys) -> dict:
    """A gpt-oss GGUF of shape keys, YaRN with `rope_keys` (GGUFWriter method suffix -> value)
    and one MXFP4 stack of experts, as the HF config conveyor reads from it."""
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_feed_forward_length(32)
    w.add_expert_feed_forward_length(32)
    w.add_head_count(4)
    w.add_key_length(16)
    w.add_vocab_size(256)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_sliding_window(128)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    for key, value in rope_keys.items():
        getattr(w, f"add_rope_scaling_{key}")(value)
    w.add_tensor("blk.0.ffn_down_exps.weight",
                 gguf.quants.quantize(torch.ones(4, 64, 32).numpy(), MXFP4), raw_dtype=MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_to_hf_config(path)


def test_gguf_config_fills_in_what_llama_cpp_fixes(tmp_path):
    cfg = _metadata(tmp_path / "a.gguf")
    config = ModelConfig.from_hf(cfg)
    # alternating layers, the first sliding; the clamped SwiGLU's constants
    assert config.layer_windows == (128, 0, 128, 0)
    assert (cfg["swiglu_alpha"], cfg["swiglu_limit"]) == (1.702, 7.0)
    # YaRN: llama.cpp's betas where the file has none; gpt-oss's unrounded ramp
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 32.0,
                                   "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False}
    assert config.quantization == "mxfp4" and config.extra["num_local_experts"] == 4
    betas = _metadata(tmp_path / "b.gguf", yarn_beta_fast=16.0, yarn_beta_slow=2.0)
    assert (betas["rope_scaling"]["beta_fast"], betas["rope_scaling"]["beta_slow"]) == (16, 2)
    with pytest.raises(ValueError, match="yarn_attn_factor"):
        _metadata(tmp_path / "c.gguf", yarn_attn_factor=1.2)
