"""Pack weights in MXFP4 (`pack_mxfp4`, the OCP microscaling layout gpt-oss publishes), and
write a tiny gpt-oss's experts that way, as the published checkpoints are."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from conveyor.kernels._util import E2M1

_MAGNITUDES = torch.tensor(E2M1[:8])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks uint8 [..., K / 32, 16], scales uint8
    [..., K / 32]): each block of 32 scaled by the power of two that brings its largest
    magnitude to at most 6, each value rounded to the nearest e2m1 code."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), -127.0).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)
    code = (scaled.abs()[..., None] - _MAGNITUDES.to(w.device)).abs().argmin(-1)  # [..., G, 32]
    code = code + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)   # [..., G, 16]
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


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
