"""gpt-oss's MXFP4 checkpoints (packed here by `pack_mxfp4`, in the published layout): the
dequantization equals transformers' bit for bit, and a tiny gpt-oss saved with MXFP4 experts
gives the greedy tokens of transformers loading the same checkpoint dequantized."""
import json

import pytest
import torch
from models_util import make_tiny_model
from safetensors.torch import load_file, save_file

from conveyor.worker.mxfp4_checkpoint import E2M1, dequantize_mxfp4

_MAGNITUDES = torch.tensor(E2M1[:8])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks uint8 [..., K / 32, 16], scales uint8
    [..., K / 32]): each block of 32 scaled by the power of two that brings its largest
    magnitude to at most 6, each value rounded to the nearest e2m1 code."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), -127.0).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)
    code = (scaled.abs()[..., None] - _MAGNITUDES).abs().argmin(-1)       # [..., G, 32]
    code = code + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)   # [..., G, 16]
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantization_equals_transformers_bit_for_bit(dtype):
    """Packed random weights (large, small, and all-zero blocks), and random bytes (every code
    and exponent, 2^127 included), through ours and transformers' convert_moe_packed_tensors
    (which returns the transpose, transformers' [E, inputs, rows])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 10, 96, generator=gen) * torch.logspace(-6, 3, 10)[:, None]
    w[1, 2, 32:64] = 0
    packed = [pack_mxfp4(w),
              (torch.randint(0, 256, (2, 7, 5, 16), generator=gen, dtype=torch.uint8),
               torch.randint(0, 255, (2, 7, 5), generator=gen, dtype=torch.uint8))]
    for blocks, scales in packed:
        ours = dequantize_mxfp4(blocks, scales, dtype)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
        assert ours.shape == theirs.shape
        assert torch.equal(ours.view(bits), theirs.contiguous().view(bits))


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


def make_mxfp4_gpt_oss(src, dst) -> None:
    """The tiny gpt-oss saved in `src`, with its experts' projections packed in MXFP4, into
    `dst` as the published checkpoints are: `*_blocks` / `*_scales` over each output row, and
    quantization_config mxfp4."""
    packed = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = pack_mxfp4(t.transpose(1, 2))      # [E, rows, inputs]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        else:
            packed[name] = t
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    save_file(packed, dst / "model.safetensors")


def test_mxfp4_model_matches_transformers(tmp_path):
    """Loaded from MXFP4 blocks and scales, the model holds the experts transformers
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
    assert config.quantization is None                   # dequantized: full precision
    ours = load_model(config, files, torch.float32, "cpu")
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", dtype=torch.float32,
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    experts = ref.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)             # [E, 2I, H]
    moe = ours.model.layers[1].mlp.experts
    assert torch.equal(moe.w13, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1))
    assert torch.equal(moe.w2, experts.down_proj.detach().transpose(1, 2))
    original = load_file(src / "model.safetensors")["model.layers.1.mlp.experts.down_proj"]
    assert not torch.equal(moe.w2, original.transpose(1, 2))            # it was quantized

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
