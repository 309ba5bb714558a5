"""gpt-oss's MXFP4 experts as published (config.json's quantization_config
{"quant_method": "mxfp4"}): kept in 4 bits for the fused-MoE kernels (`mxfp4_words`, the scale
bytes as they are), or dequantized to the model dtype (`dequantize_mxfp4`: the reference, and
the load of a rank whose share of the experts is not whole blocks).

Per MoE layer and projection P (gate_up_proj: 2I rows, gate and up interleaved, of H inputs;
down_proj: H rows of I inputs), `P_blocks` uint8 [E, rows, inputs / 32, 16] holds each block of
32 inputs as 16 bytes of two float4 e2m1 values (the low nibble the even input, the high one
the odd), and `P_scales` uint8 [E, rows, inputs / 32] one e8m0 exponent a block, biased by 127:
W[e, r, 32 b + i] = e2m1(value i of block b) * 2^(scale - 127). The rows are the outputs
(transformers' bf16 layout holds the transpose, [E, inputs, rows]).
"""
from __future__ import annotations

import torch

from conveyor.kernels._util import E2M1

BLOCK = 32                          # inputs a scale


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} ([..., G, 16] and [..., G])")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> W [..., 32 G] in dtype, on blocks'
    device. Computed as transformers' convert_moe_packed_tensors does (each e2m1 value in
    dtype, then ldexp by the exponent), so equal to it bit for bit."""
    _check(blocks, scales)
    lut = torch.tensor(E2M1, dtype=dtype, device=blocks.device)
    out = torch.empty(*blocks.shape[:-1], 32, dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    torch.ldexp(out, scales.to(torch.int32).sub_(127)[..., None], out=out)
    return out.flatten(-2)


def mxfp4_words(blocks: torch.Tensor, scales: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> (int32 words [..., 4 G], the same
    scales): the 4-bit experts' layout (layers/moe.py's make_mxfp4), value k of a row in bits
    4 (k % 8) of word k // 8 (a block's bytes read as little-endian words), and the e8m0
    bytes kept as they are (the kernels build 2^(s - 127) from each as they load it)."""
    _check(blocks, scales)
    if not blocks.is_contiguous():
        blocks = blocks.contiguous()
    words = blocks.flatten(-2).view(torch.int32)          # little-endian hosts only (x86, Arm)
    return words, scales
