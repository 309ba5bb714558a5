"""Loading checkpoints that are already quantized (the formats vLLM calls "fp8" and
"compressed-tensors"): float8 e4m3 or int8 linear weights with one scale per tensor or per
output channel, loaded as they are. The reference is transformers running the checkpoint's own
numbers: each quantized linear layer computes with its dequantized weight; for fp8 its input is
rounded to e4m3 per token (scale = the token's amax / 448), as the format's dynamic activation
scheme says; int8 runs W8A16 here (activations unrounded), so its reference rounds nothing.
"""
import json
import math
import shutil

import pytest
import torch
from models_util import make_tiny_model
from serve_util import assert_top5_close, served_outputs

from conveyor import LLM, SamplingParams

pytestmark = pytest.mark.slow

E4M3_MAX = 448.0
INT8_MAX = 127.0
PROMPTS = [[5, 17, 200, 31], list(range(40, 77)), [9] * 3 + list(range(100, 120))]
# min_tokens masks EOS as the reference's min_new_tokens does
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, ignore_eos=True)
BLOCK = 32                 # square scale blocks (128 in published checkpoints; the model is tiny)
ENGINE = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=32 << 20, max_model_len=256)


def quantization_config(method: str, strategy: str) -> dict:
    """method: "fp8" (AutoFP8), "compressed-tensors" (fp8) or "compressed-tensors-int8"
    (llm-compressor's int-quantized W8A8)."""
    if method == "fp8":
        block = {"weight_block_size": [BLOCK, BLOCK]} if strategy == "block" else {}
        return {"quant_method": "fp8", "activation_scheme": "dynamic", **block}
    kind = "int" if method.endswith("int8") else "float"
    block = {"block_structure": [BLOCK, BLOCK]} if strategy == "block" else {}
    scheme = {"targets": ["Linear"],
              "weights": {"num_bits": 8, "type": kind, "strategy": strategy,
                          "symmetric": True, "dynamic": False, **block},
              "input_activations": {"num_bits": 8, "type": kind, "strategy": "token",
                                    "dynamic": True}}
    return {"quant_method": "compressed-tensors", "format": f"{kind}-quantized",
            "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}


def kv_scale(layer: int, kind: str) -> float:
    return 0.01 * (layer + 1) * (2 if kind == "v" else 1)


def make_checkpoint(src, dst, method: str, strategy: str, kv_names: str | None = None
                    ) -> dict[str, tuple]:
    """dst: src's checkpoint with every decoder linear weight in e4m3 (int8 for the int8
    method) and its weight_scale (a scalar per tensor, or [N, 1] per channel), plus a static
    input_scale (unused); with kv_names, KV cache scales kv_scale(layer, k|v) named
    self_attn.k_scale ("k_scale") or self_attn.k_proj.output_scale ("output_scale"). Returns
    {weight name: (1-byte weight, scale)}."""
    int8 = method.endswith("int8")
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    out, quantized = {}, {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith(("proj.weight", ".w1.weight",
                                                               ".w2.weight", ".w3.weight")):
            if strategy == "block":        # one scale per BLOCK x BLOCK tile
                n, k = t.shape
                tiles = t.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax((1, 3))
                stored = (tiles / E4M3_MAX).float()                 # [N / B, K / B]
                amax = stored.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1) * E4M3_MAX
            else:
                amax = t.abs().amax(1, keepdim=True) if strategy == "channel" else t.abs().amax()
            scale = (amax / (INT8_MAX if int8 else E4M3_MAX)).float()
            if int8:
                q = (t / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
            else:
                q = (t / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            stem = name.removesuffix("weight")
            out[name], out[stem + "weight_scale"] = q, scale
            if strategy == "block":        # DeepSeek's name in "fp8" checkpoints
                del out[stem + "weight_scale"]
                key = "weight_scale_inv" if method == "fp8" else "weight_scale"
                out[stem + key] = stored
            out[stem + "input_scale"] = torch.tensor(0.5)
            quantized[name] = (q, scale)
        else:
            out[name] = t
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers if kv_names else 0):
        for kind in "kv":
            stem = f"model.layers.{i}.self_attn."
            key = stem + (f"{kind}_scale" if kv_names == "k_scale" else f"{kind}_proj.output_scale")
            out[key] = torch.tensor(kv_scale(i, kind))
    dst.mkdir()
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, strategy)
    (dst / "config.json").write_text(json.dumps(config))
    return quantized


def reference_tokens(src, quantized: dict[str, tuple], round_inputs: bool = True
                     ) -> list[list[int]]:
    """transformers on src with every quantized weight dequantized (written as a checkpoint of
    its own, so MoE experts, which transformers fuses at load, take theirs too); round_inputs:
    the quantized dense linear layers round their inputs to e4m3 per token (experts run W8A16
    in conveyor, so theirs stay exact)."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tensors = load_file(src / "model.safetensors")
    for name, (q, scale) in quantized.items():
        tensors[name] = q.float() * scale
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(src / "config.json", tmp)
        save_file(tensors, f"{tmp}/model.safetensors")
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()

    def e4m3_per_token(module, args):
        x = args[0]
        scale = x.abs().amax(-1, keepdim=True) / E4M3_MAX
        return ((x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale,)

    modules = dict(model.named_modules())
    dense = [name for name in quantized if ".experts." not in name]
    for name in dense if round_inputs else []:
        modules[name.removesuffix(".weight")].register_forward_pre_hook(e4m3_per_token)
    tokens = []
    with torch.inference_mode():
        for p in PROMPTS:
            out = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            tokens.append(out[0, len(p):].tolist())
    return tokens


def tp1_and_tp2(folder) -> tuple[list, list]:
    """The checkpoint's greedy completions (top-5 logprobs) in process and served with --tp 2
    (gloo), checked by STYLE.md's top-5 rule."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    llm = LLM(model=str(folder), device="cpu", **ENGINE)
    reference = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    served = served_outputs(PROMPTS, params, "--model", str(folder), "--tp", "2", "--device",
                            "cpu", "--skip-tokenizer-init")
    assert_top5_close(reference, served)
    return reference, served


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("src") / "llama",
                           max_position_embeddings=512)


@pytest.mark.parametrize("method,strategy", [
    ("fp8", "tensor"), ("compressed-tensors", "channel"), ("compressed-tensors", "tensor"),
    ("compressed-tensors-int8", "channel"), ("compressed-tensors-int8", "tensor"),
    ("fp8", "block"), ("compressed-tensors", "block")])
def test_checkpoint_matches_transformers_on_its_numbers(tiny, tmp_path, method, strategy):
    """Block-scaled fp8 runs W8A16 (the weight dequantized, activations unrounded)."""
    mode = "int8" if method.endswith("int8") else "fp8"
    quantized = make_checkpoint(tiny, tmp_path / "q", method, strategy)
    llm = LLM(model=str(tmp_path / "q"), **ENGINE)      # the mode comes from the checkpoint
    report = llm.quantization_report
    assert report.mode == mode and len(report.prequantized) == 2 * 4   # qkv, o, gate_up, down
    assert not report.quantized and "lm_head" in report.kept
    assert f"loaded 8 layers in {mode} from the checkpoint" in report.summary()
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ours == reference_tokens(tiny, quantized,
                                    round_inputs=mode == "fp8" and strategy != "block")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["compressed-tensors", "compressed-tensors-int8"])
def test_checkpoint_on_the_gpu_stays_close_to_the_cpu(tiny, tmp_path, method):
    """The same checkpoint through the GPU kernels (CUDA graphs; bf16 activations, so by the
    top-5 rule against the float32 CPU run): the prompts decode together (the batched GEMMs),
    then one alone (the one-row GEMV reading the checkpoint's bytes)."""
    make_checkpoint(tiny, tmp_path / "q", method, "channel")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    cpu = LLM(model=str(tmp_path / "q"), device="cpu", **ENGINE)   # "auto" would take the GPU
    gpu = LLM(model=str(tmp_path / "q"), device="cuda", gpu_memory_utilization=0.3, **ENGINE)
    for prompts in (PROMPTS, PROMPTS[:1]):
        reference = [o.outputs[0] for o in cpu.generate(prompts, params, use_tqdm=False)]
        ours = [o.outputs[0] for o in gpu.generate(prompts, params, use_tqdm=False)]
        assert_top5_close(reference, ours)


def test_fp8_checkpoint_at_tp2_stays_close_to_tp1(tiny, tmp_path):
    """Column-parallel layers split the per-channel scales by rows; row-parallel ones keep each
    row's scale whole. Not bit-equal to TP=1: a row-parallel layer's rank rounds its half of each
    token to e4m3 with its own scale. So: greedy tokens equal or, at the first divergence, each
    side's token in the other's top-5 (STYLE.md), and the first token's logprob within 0.25
    (measured: 0.077 on this model, whose weights are large: initializer_range 0.2)."""
    make_checkpoint(tiny, tmp_path / "fp8", "compressed-tensors", "channel")
    reference, served = tp1_and_tp2(tmp_path / "fp8")
    for one, other in zip(reference, served):
        first = one.token_ids[0]
        assert abs(one.logprobs[0][first].logprob - other.logprobs[0][first].logprob) < 0.25


@pytest.mark.parametrize("kv_names", ["k_scale", "output_scale"])
def test_the_checkpoints_kv_scales_serve_the_fp8_pool(tiny, tmp_path, kv_names):
    """An fp8 KV pool takes the checkpoint's per-layer scales instead of calibrating; without
    one the scales are read and unused."""
    make_checkpoint(tiny, tmp_path / "fp8", "compressed-tensors", "channel", kv_names)
    llm = LLM(model=str(tmp_path / "fp8"), kv_cache_dtype="fp8", **ENGINE)
    expected = [pytest.approx(kv_scale(i, kind)) for i in range(2) for kind in "kv"]
    assert [s for pair in llm.runner.kv_scales for s in pair] == expected
    attn = [m for m in llm.runner.model.modules() if hasattr(m, "k_scale")]
    assert [s for a in attn for s in (a.k_scale, a.v_scale)] == expected
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12
    plain = LLM(model=str(tmp_path / "fp8"), **ENGINE)
    assert plain.runner.kv_scales is None


def test_bad_fp8_checkpoints_are_refused_clearly(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    make_checkpoint(tiny, tmp_path / "fp8", "fp8", "channel")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(model=str(tmp_path / "fp8"), quantization="int8", **ENGINE)
    make_checkpoint(tiny, tmp_path / "partial", "fp8", "tensor", "k_scale")
    partial = tmp_path / "partial" / "model.safetensors"
    tensors = load_file(partial)            # one layer's v scale missing
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, partial)
    with pytest.raises(ValueError, match="KV cache scales"):
        LLM(model=str(tmp_path / "partial"), **ENGINE)
    for qc, match in (({"quant_method": "fp8", "weight_block_size": [128, 64]}, "square"),
                      ({"quant_method": "hqq"}, "'hqq' is not supported"),
                      ({"quant_method": "bitsandbytes"}, "neither load_in_8bit nor"),
                      ({"quant_method": "gptq", "bits": 3}, "4-bit weights .GPTQ: or 8-bit."),
                      ({**quantization_config("compressed-tensors-int8", "channel"),
                        "format": "pack-quantized"}, "4-bit int weights"),
                      ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                        "config_groups": {"g": {
                            "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                        "group_size": 128},
                            "input_activations": {"num_bits": 8, "type": "int"}}}},
                       "no activation quantization")):
        bad = tmp_path / f"bad-{match[:12]}"
        shutil.copytree(tmp_path / "fp8", bad)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(ValueError, match=match):
            LLM(model=str(bad), **ENGINE)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """Qwen3-MoE: 6 experts of 64 rows (whole blocks of 32), layer 1 of 3 dense."""
    return make_tiny_model("qwen3-moe", tmp_path_factory.mktemp("src") / "moe",
                           moe_intermediate_size=64, max_position_embeddings=512)


@pytest.mark.parametrize("method,strategy", [
    ("fp8", "block"), ("compressed-tensors", "block"), ("compressed-tensors", "channel"),
    ("compressed-tensors-int8", "channel")])
def test_moe_checkpoint_loads_its_experts_quantized(tiny_moe, tmp_path, method, strategy):
    """Every expert's gate/up/down in the checkpoint's bytes and scales (Qwen3-30B-A3B-FP8's
    layout for "fp8" block), run W8A16 by the experts (the router stays in full precision):
    greedy tokens equal to transformers on the dequantized weights."""
    mode = "int8" if method.endswith("int8") else "fp8"
    quantized = make_checkpoint(tiny_moe, tmp_path / "q", method, strategy)
    llm = LLM(model=str(tmp_path / "q"), **ENGINE)
    report = llm.quantization_report
    # per layer qkv and o; gate_up and down in the dense layer, the experts in the other two
    assert len(report.prequantized) == 3 * 2 + 2 + 2 and not report.quantized
    experts = [m for m in llm.runner.model.modules() if hasattr(m, "w13")]
    groups = 64 // BLOCK if strategy == "block" else 1
    for m in experts:
        assert m.w13.dtype == m.w2.dtype == (torch.int8 if mode == "int8"
                                             else torch.float8_e4m3fn)
        assert m.w13_scale.shape == (6, 128, groups) and m.w2_scale.shape == (6, 64, groups)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ours == reference_tokens(tiny_moe, quantized,
                                    round_inputs=mode == "fp8" and strategy != "block")


def test_mixtral_fp8_block_checkpoint_loads_its_experts_quantized(tmp_path):
    """Mixtral's checkpoint names its experts block_sparse_moe.experts.{e}.w1/w3/w2: they load
    into the same stacked experts, scales and all."""
    src = make_tiny_model("mixtral", tmp_path / "src", intermediate_size=64,
                          max_position_embeddings=512)
    quantized = make_checkpoint(src, tmp_path / "q", "fp8", "block")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in quantized
    llm = LLM(model=str(tmp_path / "q"), **ENGINE)
    assert "model.layers.1.mlp.experts" in llm.quantization_report.prequantized
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ours == reference_tokens(src, quantized, round_inputs=False)


def test_moe_block_checkpoint_at_tp2_equals_tp1(tiny_moe, tmp_path):
    """TP 2 over gloo: each rank takes its 32 of every expert's 64 gate/up rows with their
    scales, and the same 32 columns of down with their one block of scales. Block-scaled fp8
    runs W8A16 at any TP, so the ranks' partial sums differ from TP 1's only in float32 order:
    the top-5 rule (STYLE.md)."""
    make_checkpoint(tiny_moe, tmp_path / "fp8", "fp8", "block")
    tp1_and_tp2(tmp_path / "fp8")


def test_moe_awq_checkpoint_at_tp2_equals_tp1(tiny_moe, tmp_path):
    """4-bit experts at TP 2: each rank takes its 32 gate/up rows of every expert with their
    scales and zero points, and down's words, groups and zero points of its 32 columns."""
    from int4_util import write_int4

    write_int4(tiny_moe, tmp_path / "awq", tmp_path / "ref", "awq", BLOCK)
    tp1_and_tp2(tmp_path / "awq")


def test_moe_w4a16_checkpoint_at_tp2_equals_tp1(tiny_moe, tmp_path):
    """compressed-tensors' W4A16 (zero points packed along the outputs) shards as AWQ does,
    once converted: attention, the dense layer and the experts."""
    from int4_util import write_w4a16

    write_w4a16(tiny_moe, tmp_path / "w4a16", tmp_path / "ref", BLOCK, symmetric=False)
    tp1_and_tp2(tmp_path / "w4a16")


def test_moe_block_checkpoint_not_whole_blocks_is_refused(tiny_moe, tmp_path):
    """Experts of 64 rows at TP 4 leave 16 a rank: half a block of 32."""
    from conveyor.worker.layers.moe import FusedMoE

    layer = FusedMoE(6, 2, 64, 64, True, torch.float32)
    layer.inter = 16                               # as TP 4 would shard it
    with pytest.raises(ValueError, match="not whole scale blocks of 32"):
        layer.make_quantized(torch.float8_e4m3fn, BLOCK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_block_checkpoint_on_the_gpu_stays_close_to_the_cpu(tiny_moe, tmp_path):
    """The fused-MoE kernels scaling each K step's weight tile by its block (CUDA graphs, bf16
    activations): the top-5 rule against the float32 CPU run."""
    make_checkpoint(tiny_moe, tmp_path / "q", "fp8", "block")
    gpu_close_to_cpu(tmp_path / "q")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["gptq8", "w4a16"])
def test_gptq8_and_w4a16_checkpoints_on_the_gpu_stay_close_to_the_cpu(tiny_moe, tmp_path, fmt,
                                                                     monkeypatch):
    """8-bit GPTQ (int8 with a scale a group of 32, dense layers and experts) and
    compressed-tensors W4A16 through the GPU kernels: the top-5 rule against the CPU run.

    W4A16 (asymmetric, groups of 32): every 4-bit kernel call the engine makes outside a CUDA
    graph capture (the prefills, eager steps) is checked against its torch reference on the
    same inputs, within two ulps of the output's largest value; the tokens against the CPU's
    by the top-10 rule. Those calls are as close as bf16 can make them (one ulp at most on an
    H100, 2026-12-05), yet this tiny model's first token is 13 on the GPU and 43 on the CPU
    in bf16 and in float16 alike, 13 being the CPU's sixth: its random routers flip an expert
    choice at that token, where the top-5 rule, meant for one model's rounding, fails."""
    from int4_util import write_gptq8, write_w4a16

    if fmt == "gptq8":
        write_gptq8(tiny_moe, tmp_path / "q", tmp_path / "ref", BLOCK)
        gpu_close_to_cpu(tmp_path / "q")
        return
    write_w4a16(tiny_moe, tmp_path / "q", tmp_path / "ref", BLOCK, symmetric=False)
    errors = _int4_kernel_errors(monkeypatch)
    gpu_close_to_cpu(tmp_path / "q", top=10)
    assert {kind for kind, _, _ in errors} == {"linear", "moe"}
    for kind, err, scale in errors:
        ulp = 2.0 ** (math.ceil(math.log2(max(scale, 1e-30))) - 7)        # bf16's at the max
        assert err <= 2 * ulp, (kind, err, scale)


def _int4_kernel_errors(monkeypatch) -> list[tuple[str, float, float]]:
    """Wrap the W4A16 GEMM and the fused-MoE kernel so that each call outside a CUDA graph
    capture records (kind, max |kernel - reference|, max |reference|)."""
    from conveyor.kernels import fused_moe as fm
    from conveyor.kernels import w4a16_gemm as wg

    errors = []

    def record(kind, got, want):
        if not torch.cuda.is_current_stream_capturing():
            errors.append((kind, float((got.float() - want.float()).abs().max()),
                           float(want.float().abs().max())))

    gemm, moe = wg.w4a16_gemm, fm.fused_moe

    def checked_gemm(x, qweight, scale, zero, bias=None, perm=None):
        y = gemm(x, qweight, scale, zero, bias, perm)
        if not torch.cuda.is_current_stream_capturing():
            record("linear", y, wg.w4a16_ref(x, qweight, scale, zero, bias, perm))
        return y

    def checked_moe(x, w13, w2, weights, ids, tiles=None, *scales, **extra):
        y = moe(x, w13, w2, weights, ids, tiles, *scales, **extra)
        if not torch.cuda.is_current_stream_capturing():
            record("moe", y, fm.fused_moe_ref(x, w13, w2, weights, ids, *scales, **extra))
        return y

    monkeypatch.setattr(wg, "w4a16_gemm", checked_gemm)
    monkeypatch.setattr(fm, "fused_moe", checked_moe)
    return errors


def gpu_close_to_cpu(folder, top: int = 5) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=top)
    cpu = LLM(model=str(folder), device="cpu", **ENGINE)
    gpu = LLM(model=str(folder), device="cuda", gpu_memory_utilization=0.3, **ENGINE)
    for prompts in (PROMPTS, PROMPTS[:1]):
        reference = [o.outputs[0] for o in cpu.generate(prompts, params, use_tqdm=False)]
        ours = [o.outputs[0] for o in gpu.generate(prompts, params, use_tqdm=False)]
        assert_top5_close(reference, ours)
