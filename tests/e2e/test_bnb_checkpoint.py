"""bitsandbytes checkpoints, made by transformers and bitsandbytes themselves on the CPU (what
`save_pretrained` writes for a model loaded with load_in_4bit or load_in_8bit, as the hub's
"bnb-4bit" releases are): 4-bit NF4 and FP4 weights are dequantized at load to bitsandbytes'
own dequantized values, 8-bit weights load as int8 with a scale a row; both give transformers'
greedy tokens on the dequantized weights."""
from __future__ import annotations

import shutil

import pytest
import torch
from models_util import make_tiny_model

from conveyor import LLM, SamplingParams

pytestmark = pytest.mark.slow
bnb = pytest.importorskip("bitsandbytes")

PROMPTS = [[5, 17, 200, 31], list(range(40, 77)), [9] * 3 + list(range(100, 120))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, ignore_eos=True)
ENGINE = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=32 << 20, max_model_len=256,
              device="cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("src") / "llama",
                           max_position_embeddings=512)


def quantized(src, dst, **bnb_options) -> dict[str, torch.Tensor]:
    """Save to dst transformers' model of src loaded through bitsandbytes with bnb_options;
    returns its 4-bit weights as bitsandbytes dequantizes them ({} for 8 bits)."""
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(**bnb_options)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config,
                                                 device_map="cpu", dtype=torch.float32)
    model.save_pretrained(dst)
    return {f"{name}.weight": dequantize_4bit(m.weight.data, m.weight.quant_state)
            for name, m in model.named_modules() if hasattr(getattr(m, "weight", None),
                                                              "quant_state")}


def reference_tokens(src, folder, weights: dict[str, torch.Tensor]) -> list[list[int]]:
    """transformers on src's model with `weights` in place (in float32): bitsandbytes' own
    matmuls round activations (8 bits) or run in the weights' dtype (4 bits, on the CPU)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tensors = load_file(src / "model.safetensors")
    tensors.update({name: w.float() for name, w in weights.items()})
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    shutil.copy(src / "config.json", folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                               do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long)
                               )[0, len(p):].tolist() for p in PROMPTS]


def ours(folder, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(folder), **ENGINE, **options)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("nf4", False), ("fp4", False)])
def test_4bit_checkpoint_loads_as_bitsandbytes_dequantizes_it(tiny, tmp_path, quant_type,
                                                              double):
    want = quantized(tiny, tmp_path / "q", load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                     bnb_4bit_use_double_quant=double)
    assert len(want) == 2 * 7                                   # q, k, v, o, gate, up, down
    llm, tokens = ours(tmp_path / "q")
    assert llm.quantization_report is None          # dequantized: full precision from here
    qkv = llm.runner.model.model.layers[1].self_attn.qkv_proj.weight
    q = want["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(qkv[:q.shape[0]], q.float())
    assert tokens == reference_tokens(tiny, tmp_path / "ref", want)


def test_4bit_checkpoint_quantized_again_with_int8(tiny, tmp_path):
    quantized(tiny, tmp_path, load_in_4bit=True, bnb_4bit_quant_type="nf4")
    llm, tokens = ours(tmp_path, quantization="int8")
    assert llm.quantization_report.mode == "int8" and len(llm.quantization_report.quantized) == 8
    assert len(tokens) == 3 and all(len(t) == 12 for t in tokens)


def test_8bit_checkpoint_loads_as_int8_rows(tiny, tmp_path):
    """LLM.int8's weights and row maxima (SCB): int8 weights with SCB / 127 a row, checked
    against transformers on those weights dequantized."""
    from safetensors.torch import load_file

    quantized(tiny, tmp_path / "q", load_in_8bit=True)
    llm, tokens = ours(tmp_path / "q")
    report = llm.quantization_report
    assert report.mode == "int8" and len(report.prequantized) == 2 * 4     # qkv, o, gate_up, down
    assert "loaded 8 layers in int8 from the checkpoint" in report.summary()
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    weights = {name: t.float() * tensors[name.removesuffix("weight") + "SCB"][:, None] / 127
               for name, t in tensors.items() if t.dtype == torch.int8}
    assert len(weights) == 2 * 7
    assert tokens == reference_tokens(tiny, tmp_path / "ref", weights)


def test_incomplete_or_tiled_checkpoints_are_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    quantized(tiny, tmp_path / "q4", load_in_4bit=True, bnb_4bit_quant_type="nf4")
    tensors = load_file(tmp_path / "q4" / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight.quant_map"]
    save_file(tensors, tmp_path / "q4" / "model.safetensors")
    with pytest.raises(ValueError, match="without all their parts.*layers.1.mlp.down_proj"):
        LLM(model=str(tmp_path / "q4"), **ENGINE)
    quantized(tiny, tmp_path / "q8", load_in_8bit=True)
    tensors = load_file(tmp_path / "q8" / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight_format"] = torch.tensor(1, dtype=torch.uint8)
    save_file(tensors, tmp_path / "q8" / "model.safetensors")
    with pytest.raises(ValueError, match="tiled format"):
        LLM(model=str(tmp_path / "q8"), **ENGINE)
