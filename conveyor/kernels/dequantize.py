"""Dequantize a 1-byte weight: W [N, K] int8 or float8_e4m3fn, scale float32 [N, G] (each of a
row's G scales covering K / G consecutive columns) -> W * scale [N, K] in bf16/fp16/fp32, in
float32 and rounded once, in one pass (int8 prefill: the weight dequantized, then cuBLAS).
"""
import torch

from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import FLOAT_DTYPES, check

_BLOCK = 1024


@jit
def _dequantize_kernel(w_ptr, scale_ptr, out_ptr, K, stride_w, stride_s, stride_o,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    w = tl.load(w_ptr + row * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + row * stride_s + cols // GROUP, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] (int8 or fp8) * scale [N, G] -> [N, K] in dtype, new."""
    require_triton()
    n, k = weight.shape
    check(weight.dtype in (torch.int8, torch.float8_e4m3fn) and weight.stride(1) == 1,
          f"weight must be int8 or float8_e4m3fn [N, K] with unit column stride, got "
          f"{weight.dtype} strides {weight.stride()}")
    check(scale.dtype == torch.float32 and scale.dim() == 2 and scale.shape[0] == n
          and k % scale.shape[1] == 0 and scale.stride(1) == 1,
          f"scale must be float32 [N, G] with G dividing K, got {tuple(scale.shape)} "
          f"{scale.dtype} for weight {tuple(weight.shape)}")
    check(dtype in FLOAT_DTYPES, f"dtype must be a float dtype, got {dtype}")
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if n and k:
        _dequantize_kernel[(n, -(-k // _BLOCK))](
            weight, scale, out, k, weight.stride(0), scale.stride(0), out.stride(0),
            GROUP=k // scale.shape[1], BLOCK=_BLOCK, num_warps=4)
    return out


def dequantize_ref(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same in torch (also the CPU path): float32 products, rounded once to dtype."""
    n, k = weight.shape
    return (weight.float().view(n, scale.shape[1], -1) * scale[:, :, None]).view(n, k).to(dtype)
