"""SiLU-gated activation of a fused gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import triton_available


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and triton_available():
            from conveyor.kernels.silu_and_mul import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)    # x: [T, 2 * intermediate]
        return F.silu(gate) * up         # [T, intermediate]
