"""RMSNorm, computed in float32 like Hugging Face, with an optional fused residual add, and
optionally the tensor-parallel all-reduce of its input before it; LayerNorm (Cohere's: the mean
subtracted, no bias) with the same interface, in torch ops.

On CUDA (with Triton) one fused kernel does the add and the norm (and, in the CUDA graphs of
decode steps under tensor parallelism, the all-reduce too: layers/parallel.py); elsewhere,
torch ops.
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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                reduce: bool = False, fp8: bool = False):
        """Normalise x; with a residual, normalise x + residual and also return that sum.
        reduce: x is this rank's partial sum (a row-parallel layer's output, not yet reduced);
        the sum over the tensor-parallel ranks is normalised.
        fp8: the next layer takes fp8 rows (LinearBase.takes_fp8_rows): on CUDA the normed rows
        come back quantized, as Fp8Rows, where one kernel does both.

        NOTE: the add runs in the model dtype, as in Hugging Face's decoder layers.
        """
        if reduce:
            from conveyor.worker.layers.parallel import all_reduce_rms_norm

            return all_reduce_rms_norm(x, self, residual, fp8)
        if x.is_cuda and x.dim() == 2 and triton_available():
            from conveyor.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, fp8)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class WeightlessRMSNorm(nn.Module):
    """x / rms(x) in float32, rounded to x's dtype, without a weight (Llama 4's q/k norm); the
    (size, eps, dtype) of RMSNorm's constructor, size and dtype unused."""

    def __init__(self, size: int = 0, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features split across the tensor-parallel ranks (OLMo's q and k norms, over
    all heads): each rank holds its features' weights and normalises them by the mean square of
    all the features (one all-reduce of a [T, 1] sum). In float32, the weight applied before
    the rounding to x's dtype, as OLMo's norm does."""

    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        from conveyor.worker.layers.parallel import tp_size

        super().__init__()
        self.eps = eps
        self.ranks = tp_size()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        from conveyor.worker.layers.parallel import tp_rank

        n = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, tp_rank() * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from conveyor.worker.layers.parallel import all_reduce

        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.ranks > 1:
            squares = all_reduce(squares)
        mean = squares / (x.shape[-1] * self.ranks)
        return (self.weight * (xf * torch.rsqrt(mean + self.eps))).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm in float32: mean-subtracted, scaled, without a bias (Cohere's) or with one
    (StarCoder2's); RMSNorm's forward (residual add, reduce), in torch ops everywhere."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                reduce: bool = False, fp8: bool = False):
        """As RMSNorm.forward; fp8 is not taken (the rows come back in x's dtype)."""
        if reduce:
            from conveyor.worker.layers.parallel import all_reduce

            x = all_reduce(x)
        if residual is not None:
            x = x + residual
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps)
        return out.to(x.dtype) if residual is None else (out.to(x.dtype), x)
