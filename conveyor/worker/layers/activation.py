"""Gated activations of a fused gate/up projection: SiLU (Llama, Qwen), GELU-tanh (Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.kernels import triton_available


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * intermediate] (gate, then up) -> silu(gate) * up [T, intermediate]."""
    if x.is_cuda and triton_available():
        from conveyor.kernels.silu_and_mul import silu_and_mul as fused

        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up



def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * intermediate] (gate, then up) -> gelu_tanh(gate) * up (Gemma's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
