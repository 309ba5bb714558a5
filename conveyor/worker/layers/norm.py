"""RMSNorm, computed in float32 like Hugging Face, with an optional fused residual add.

On CUDA (with Triton) one fused kernel does the add and the norm; elsewhere, torch ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import triton_available


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:     # the same math, in one fused call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x; with a residual, normalise x + residual and also return that sum.

        NOTE: the add runs in the model dtype, as in Hugging Face's decoder layers.
        """
        if x.is_cuda and x.dim() == 2 and triton_available():
            from conveyor.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
