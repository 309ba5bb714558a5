"""Per-token (row) dynamic fp8 quantization of activations: x [M, K] bf16/fp16 ->
(q [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~= q * scale, scale = amax(|row|) / 448.

One program per row: a pass for the row's amax, a second (from L2) that divides, rounds to
nearest even and stores. The input of fp8 W8A8 GEMMs (fp8_gemm.py).
"""
import torch

from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import FP8_MAX, check

MIN_SCALE = 1e-12 / FP8_MAX      # an all-zero row gets a tiny scale, not a division by zero
_BLOCK = 1024


@jit
def _quant_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                      FP8_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=k + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, 1e-12 / FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for k in tl.range(0, K, BLOCK):
        mask = k + cols < K
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)   # as torch divides: exactly
        tl.store(q_ptr + row * stride_q + k + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (q [M, K] float8_e4m3fn, scale [M, 1] float32), both new."""
    require_triton()
    check(x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float16, torch.bfloat16,
                                                            torch.float32),
          f"quant_fp8 takes x [M, K] fp16/bf16/fp32 with unit column stride, got "
          f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quant_fp8_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=_BLOCK,
                                FP8_MAX=FP8_MAX, num_warps=4)
    return q, scale


def quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
