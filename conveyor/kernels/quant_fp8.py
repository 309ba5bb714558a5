"""Per-token (row) dynamic fp8 quantization of activations: x [M, K] bf16/fp16 ->
(q [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~= q * scale, scale = amax(|row|) / 448.
One program holds a row in registers: amax, then divide, round to nearest even, store. With
silu_mul it quantizes silu(gate) * up of the MLP's gate/up output, and rms_norm.py's kernel
quantizes its rows through store_fp8_row; both round to the activation dtype first, so the
bytes equal the separate kernels'. Design and figures: docs/QUANTIZATION.md, "Kernels".
"""
import torch

from conveyor.kernels._triton import grid_sync, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import FP8_MAX, check, next_pow2
from conveyor.kernels.silu_and_mul import silu_mul, silu_mul_ref

MIN_SCALE = 1e-12 / FP8_MAX      # an all-zero row gets a tiny scale, not a division by zero
MAX_K = 65536                    # the longest row a program holds (128 values a thread)
_FP8_MAX = tl.constexpr(FP8_MAX)  # globals a kernel may read: constexprs
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@jit
def store_fp8_row(x, q_ptr, scale_ptr, cols, mask):
    """Quantize one row x [BLOCK] (float32, zeros outside mask) to q_ptr + cols, its scale to
    scale_ptr: amax / 448, the values divided as torch divides (exactly), clamped, rounded to
    nearest even."""
    scale = tl.maximum(tl.max(tl.abs(x), 0) / _FP8_MAX, _MIN_SCALE)
    tl.store(scale_ptr, scale)
    q = tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
    tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@jit
def _quant_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                      SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if SILU_MUL:                  # x is gate, up: silu(gate) * up, rounded to their dtype
        x = silu_mul(x, tl.load(x_ptr + row * stride_x + K + cols, mask=mask, other=0.0),
                     x_ptr.dtype.element_ty)
    store_fp8_row(x.to(tl.float32), q_ptr + row * stride_q, scale_ptr + row, cols, mask)


def quant_fp8(x: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (q [M, K] float8_e4m3fn, scale [M, 1] float32), both new.

    silu_mul: x is [M, 2K], gate then up, and silu(gate) * up (rounded to x's dtype, as
    kernels/silu_and_mul.py rounds it) is quantized."""
    require_triton()
    check(x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float16, torch.bfloat16,
                                                            torch.float32),
          f"quant_fp8 takes x [M, K] fp16/bf16/fp32 with unit column stride, got "
          f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    m, k = x.shape
    if silu_mul:
        check(k % 2 == 0, f"silu_mul takes x [M, 2K] (gate, up), got {tuple(x.shape)}")
        k //= 2
    check(k <= MAX_K, f"quant_fp8 holds a row in registers: K {k} is over {MAX_K}")
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = next_pow2(max(k, 16))
        _quant_fp8_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block,
                                SILU_MUL=silu_mul,
                                num_warps=min(16, max(4, block // 1024)), **pdl_args())
    return q, scale


def quant_fp8_ref(x: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if silu_mul:
        x = silu_mul_ref(x)
    scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
