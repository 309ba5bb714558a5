"""AWQ and GPTQ checkpoints (packed by tests/int4_util.py in the published layouts; group sizes
32, 64 and 128; GPTQ with and without act-order) load as they are and give transformers' greedy
tokens and logits on the dequantized weights (the CPU path: dequantize, then matmul)."""
import pytest
import torch
from int4_util import write_gptq8, write_int4, write_w4a16
from models_util import make_tiny_model

from conveyor.kernels.w4a16_gemm import dequantize_int4, pack_int4, unpack_int4, w4a16_ref
from conveyor.shared.model_files import read_model_config, resolve_model
from conveyor.worker.loader import load_model


def assert_matches_reference(ours, ref_folder, eos: int) -> None:
    """A prompt's logits and 10 greedy tokens from `ours` equal transformers' on ref_folder
    (the dequantized weights)."""
    from test_models import greedy, hf_greedy, pool_for, run_step
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    prompt = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = run_step(ours, pool_for(ours), {0: prompt}, [(0, len(prompt))], 0)[0]
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    got = [t[:t.index(eos) + 1] if eos in t else t for t in greedy(ours, [prompt], 10)]
    assert got == hf_greedy(ref, [prompt], 10)


CASES = [("awq", 32, False), ("awq", 128, False), ("gptq", 64, False), ("gptq", 128, True),
         ("gptq", 32, True)]


@pytest.mark.parametrize("fmt,group,act_order", CASES)
def test_int4_checkpoint_matches_transformers_on_dequantized_weights(tmp_path, fmt, group,
                                                                     act_order):
    src = make_tiny_model("qwen3", tmp_path / "src", hidden_size=128, intermediate_size=256,
                          head_dim=32)
    write_int4(src, tmp_path / "q", tmp_path / "ref", fmt, group, act_order)
    files = resolve_model(str(tmp_path / "q"))
    config = read_model_config(files)
    assert config.quantization == fmt
    ours = load_model(config, files, torch.float32, "cpu", quantization=fmt)
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int32 and qkv.weight_scale.shape[1] == 128 // group
    assert (qkv.weight_perm is not None) == act_order
    assert ours.quant_report.prequantized
    assert_matches_reference(ours, tmp_path / "ref", config.eos_token_ids[0])


W4A16_CASES = [(32, True, False), (64, False, False), (32, True, True), (0, False, False)]


@pytest.mark.parametrize("group,symmetric,act_order", W4A16_CASES)
def test_compressed_tensors_w4a16_matches_transformers(tmp_path, group, symmetric, act_order):
    """llm-compressor's W4A16 format (compressed-tensors pack-quantized; packed by
    compressed-tensors itself), symmetric or with zero points, by group or channel, with
    act-order's g_idx or not: logits and greedy tokens equal transformers running the same
    checkpoint through compressed-tensors (symmetric, no g_idx: what it still reads), else
    transformers on the dequantized weights."""
    src = make_tiny_model("qwen3", tmp_path / "src", hidden_size=128, intermediate_size=256,
                          head_dim=32)
    write_w4a16(src, tmp_path / "q", tmp_path / "ref", group, symmetric, act_order)
    files = resolve_model(str(tmp_path / "q"))
    config = read_model_config(files)
    assert config.quantization == "w4a16"
    ours = load_model(config, files, torch.float32, "cpu", quantization="w4a16")
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int32 and qkv.weight_scale.shape[1] == (
        128 // group if group else 1)
    assert (qkv.weight_perm is not None) == act_order
    assert ours.quant_report.prequantized
    reference = "q" if symmetric and not act_order else "ref"
    assert_matches_reference(ours, tmp_path / reference, config.eos_token_ids[0])


@pytest.mark.parametrize("group", [128, 0])
def test_gptq_8_bit_checkpoint_matches_transformers(tmp_path, group):
    """8-bit GPTQ (Qwen's GPTQ-Int8 layout: symmetric, in order) loads as int8 weights with one
    scale a group (the Q8_0 path): transformers' tokens on the dequantized weights, dense
    layers and experts; asymmetric zero points and act-order are refused by name."""
    import json

    for arch, extra in (("qwen3", {}), ("qwen3-moe", {"moe_intermediate_size": 128})):
        src = make_tiny_model(arch, tmp_path / arch / "src", hidden_size=128,
                              intermediate_size=256, head_dim=32, **extra)
        write_gptq8(src, tmp_path / arch / "q", tmp_path / arch / "ref", group)
        files = resolve_model(str(tmp_path / arch / "q"))
        config = read_model_config(files)
        assert config.quantization == "gptq"
        ours = load_model(config, files, torch.float32, "cpu")
        qkv = ours.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.int8 and qkv.weight_zero is None
        assert qkv.weight_scale.shape[1] == (128 // group if group else 1)
        assert_matches_reference(ours, tmp_path / arch / "ref", config.eos_token_ids[0])
    moe = ours.model.layers[0].mlp.experts
    assert moe.w13.dtype == torch.int8 and moe.w13_scale.shape[-1] == (128 // group
                                                                        if group else 1)
    q = tmp_path / "qwen3" / "q"
    config = json.loads((q / "config.json").read_text())
    for change, words in (({"desc_act": True}, "act-order"), ({"sym": False}, "symmetric")):
        (q / "config.json").write_text(json.dumps(
            {**config, "quantization_config": {**config["quantization_config"], **change}}))
        files = resolve_model(str(q))
        with pytest.raises(ValueError, match=words):
            load_model(read_model_config(files), files, torch.float32, "cpu")


def test_pack_unpack_and_reference():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 64), generator=gen, dtype=torch.uint8)
    words = pack_int4(q)
    assert words.dtype == torch.int32 and words.shape == (24, 8)
    assert torch.equal(unpack_int4(words), q)
    scale, zero = torch.rand(24, 2, generator=gen), torch.randint(0, 16, (24, 2)).float()
    w = (q.float().view(24, 2, 32) - zero[..., None]) * scale[..., None]
    assert torch.equal(dequantize_int4(words, scale, zero, torch.float32), w.view(24, 64))
    x = torch.randn(3, 64, generator=gen)
    perm = torch.randperm(64, generator=gen)
    torch.testing.assert_close(w4a16_ref(x, words, scale, zero, None, perm),
                               x[:, perm] @ w.view(24, 64).t())


def test_llm_serves_a_gptq_checkpoint(tmp_path):
    """The whole engine (LLM, CPU) on an act-order GPTQ checkpoint: transformers' tokens on the
    dequantized weights, and the report names the layers loaded in 4 bits."""
    from transformers import AutoModelForCausalLM

    from conveyor import LLM, SamplingParams

    src = make_tiny_model("llama", tmp_path / "src", hidden_size=128, intermediate_size=256,
                          head_dim=32)
    write_int4(src, tmp_path / "q", tmp_path / "ref", "gptq", 64, act_order=True)
    llm = LLM(model=str(tmp_path / "q"), device="cpu", skip_tokenizer_init=True,
              kv_cache_memory_bytes=16 << 20, max_model_len=128)
    assert "loaded 8 layers in gptq from the checkpoint" in llm.quantization_report.summary()
    prompts = [[5, 17, 99, 3, 250, 41, 8], [7] * 20]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == want


def test_dummy_weights_for_an_int4_checkpoint_are_refused_by_name(tmp_path):
    from conveyor import LLM

    src = make_tiny_model("llama", tmp_path / "src", hidden_size=128, intermediate_size=256,
                          head_dim=32)
    write_int4(src, tmp_path / "q", tmp_path / "ref", "awq", 64)
    with pytest.raises(ValueError, match="load_format dummy cannot stand in for a 4-bit awq"):
        LLM(model=str(tmp_path / "q"), device="cpu", skip_tokenizer_init=True,
            kv_cache_memory_bytes=16 << 20, max_model_len=128, load_format="dummy")


@pytest.mark.parametrize("fmt,group", [("awq", 32), ("gptq", 64), ("awq", 0)])
def test_moe_int4_checkpoint_matches_transformers(tmp_path, fmt, group):
    """Qwen3-MoE with every expert in 4 bits (as Qwen3-30B-A3B-GPTQ-Int4 and the AWQ releases
    are published): the experts keep their words, scales and zero points, and the logits and
    greedy tokens are transformers' on the dequantized weights (group 0: one a row)."""
    src = make_tiny_model("qwen3-moe", tmp_path / "src", hidden_size=128, head_dim=32,
                          moe_intermediate_size=64, intermediate_size=256)
    write_int4(src, tmp_path / "q", tmp_path / "ref", fmt, group or -1)
    files = resolve_model(str(tmp_path / "q"))
    config = read_model_config(files)
    ours = load_model(config, files, torch.float32, "cpu", quantization=fmt)
    experts = ours.model.layers[0].mlp.experts
    groups = (128 // group, 64 // group) if group else (1, 1)
    assert experts.w13.dtype == torch.int32 and experts.w13.shape == (6, 128, 16)
    assert experts.w13_zero.shape == (6, 128, groups[0])
    assert experts.w2_scale.shape == (6, 128, groups[1])
    assert "model.layers.2.mlp.experts" in ours.quant_report.prequantized
    assert_matches_reference(ours, tmp_path / "ref", config.eos_token_ids[0])


def test_moe_w4a16_checkpoint_matches_transformers(tmp_path):
    """Qwen3-MoE in compressed-tensors' W4A16 (as the "quantized.w4a16" MoE releases): the
    experts keep their words; transformers on the dequantized weights gives the same tokens."""
    src = make_tiny_model("qwen3-moe", tmp_path / "src", hidden_size=128, head_dim=32,
                          moe_intermediate_size=64, intermediate_size=256)
    write_w4a16(src, tmp_path / "q", tmp_path / "ref", 32, symmetric=False)
    files = resolve_model(str(tmp_path / "q"))
    config = read_model_config(files)
    ours = load_model(config, files, torch.float32, "cpu")
    experts = ours.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.int32 and experts.w13_zero.shape == (6, 128, 4)
    assert_matches_reference(ours, tmp_path / "ref", config.eos_token_ids[0])


def test_mixtral_gptq_checkpoint_matches_transformers(tmp_path):
    """Mixtral's experts (block_sparse_moe.experts.{e}.w1/w3/w2) in 4 bits load into the same
    stacked experts."""
    src = make_tiny_model("mixtral", tmp_path / "src", hidden_size=128, head_dim=32,
                          intermediate_size=64)
    write_int4(src, tmp_path / "q", tmp_path / "ref", "gptq", 32)
    files = resolve_model(str(tmp_path / "q"))
    config = read_model_config(files)
    ours = load_model(config, files, torch.float32, "cpu", quantization="gptq")
    assert ours.model.layers[1].mlp.experts.w2.dtype == torch.int32
    assert_matches_reference(ours, tmp_path / "ref", config.eos_token_ids[0])


def test_moe_act_order_checkpoint_is_refused(tmp_path):
    src = make_tiny_model("qwen3-moe", tmp_path / "src", hidden_size=128, head_dim=32,
                          moe_intermediate_size=64, intermediate_size=256)
    write_int4(src, tmp_path / "q", tmp_path / "ref", "gptq", 32, act_order=True)
    files = resolve_model(str(tmp_path / "q"))
    with pytest.raises(ValueError, match="act-order"):
        load_model(read_model_config(files), files, torch.float32, "cpu", quantization="gptq")
