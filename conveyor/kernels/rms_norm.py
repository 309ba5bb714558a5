"""RMSNorm with an optional fused residual add, rounding like the torch layer (and HF): the sum
x + residual is rounded to the model dtype, normalised in float32, rounded, then scaled by the
weight. One program per row. With fp8 the normalised rows leave quantized per row for an fp8
GEMM (_util.Fp8Rows), rounded to the model dtype first: the bytes of rms_norm then quant_fp8,
without the 16-bit rows written and read back or the second launch.
"""
import torch

from conveyor.kernels._triton import grid_sync, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import Fp8Rows, check, next_pow2
from conveyor.kernels.quant_fp8 import quant_fp8, store_fp8_row


@jit
def rms_normalize(x, w, eps, N):
    """RMSNorm of one row x [BLOCK] (the model dtype; zeros past N) times w, in float32,
    rounded like the torch layer: normalised in float32, rounded to x's dtype, then scaled.
    Also the norm of kernels/all_reduce.py's fused path."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    return (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     FP8: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    y = rms_normalize(x, tl.load(w_ptr + cols, mask=mask, other=0.0), eps, N)
    if FP8:                       # out is float8 e4m3; the weight has x's dtype
        store_fp8_row(y.to(x.dtype).to(tl.float32), out_ptr + row * stride_o, scale_ptr + row,
                      cols, mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, fp8: bool = False):
    """x [T, N] (rows may be strided) -> normed [T, N]; with a residual, also x + residual.

    Returns `normed` or `(normed, x + residual)`, both new contiguous tensors. fp8: normed is
    Fp8Rows, the rows quantized per row as quant_fp8 quantizes them.
    """
    require_triton()
    check(x.dim() == 2 and x.stride(1) == 1, f"x must be [T, N] with unit column stride, got "
          f"{tuple(x.shape)} strides {x.stride()}")
    t, n = x.shape
    check(weight.shape == (n,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} for "
          f"rows of {n}")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x dtype {x.dtype}")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if fp8 and out_dtype != x.dtype:   # the rows would be rounded to another dtype: two kernels
        out = rms_norm(x, weight, eps, residual)
        normed = out if residual is None else out[0]
        normed = Fp8Rows(*quant_fp8(normed), normed.dtype)
        return normed if residual is None else (normed, out[1])
    out = torch.empty((t, n), dtype=torch.float8_e4m3fn if fp8 else out_dtype, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device) if fp8 else None
    res_out = None
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1,
              f"residual {tuple(residual.shape)} {residual.dtype} for x {tuple(x.shape)} "
              f"{x.dtype}")
        res_out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        block = next_pow2(n)
        _rms_norm_kernel[(t,)](x, r, weight, out, ro, scale if fp8 else out, eps, x.stride(0),
                               r.stride(0), out.stride(0), ro.stride(0), N=n, BLOCK=block,
                               HAS_RESIDUAL=residual is not None, FP8=fp8,
                               num_warps=min(16, max(1, block // 256)), **pdl_args())
    if fp8:
        out = Fp8Rows(out, scale, x.dtype)
    return out if residual is None else (out, res_out)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """The torch layer's math (conveyor.worker.layers.norm.RMSNorm)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)
