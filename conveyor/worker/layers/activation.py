"""SiLU-gated activation of a fused gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)    # x: [T, 2 * intermediate]
        return F.silu(gate) * up         # [T, intermediate]
