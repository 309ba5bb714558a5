"""y = x W^T (+ bias) for one row of x (single-stream decode): x [1, K] bf16/fp16, W [N, K] as
nn.Linear stores it, in x's dtype or int8/fp8 with a float32 scale [N, G] (G = 1: one per row;
else one per K / G columns, GGUF Q8_0's 32); float32 accumulation, y in x's dtype. With
silu_mul, x is the fused gate/up output [1, 2K] and silu(gate) * up is computed as it loads.
A stream of W: BLOCK_N rows a program, no tensor cores, a software-pipelined loop (cp.async).
Design and figures: docs/ARCHITECTURE.md, "Skinny GEMM"; docs/QUANTIZATION.md, "Kernels".
"""
import torch

from conveyor.kernels._triton import grid_wait, jit, launch_next, pdl_args, require_triton, tl
from conveyor.kernels._util import check, next_pow2, num_sms
from conveyor.kernels.dequantize import dequantize_ref
from conveyor.kernels.silu_and_mul import silu_mul, silu_mul_ref

M_MAX = 1
_STAGE_BYTES = 4096      # of W per program and pipeline stage (twice that with silu_mul)
_STAGES = 3
_WARPS = 2


@jit
def _load_x(x_ptr, ks, K, mask, SILU_MUL: tl.constexpr, dtype: tl.constexpr):
    """x's columns ks; with SILU_MUL silu(gate) * up of a [1, 2K] gate/up row, rounded to the
    activation dtype as the separate silu_and_mul kernel rounds it."""
    if SILU_MUL:
        return silu_mul(tl.load(x_ptr + ks, mask=mask, other=0.0),
                        tl.load(x_ptr + K + ks, mask=mask, other=0.0), dtype)
    return tl.load(x_ptr + ks, mask=mask, other=0.0)


@jit
def int8_to_float(w):
    """int8 -> float32, exactly, with integer ops instead of I2F (quarter rate on Hopper): the
    byte b, zero-extended and XORed with 0x4B000080, is the float 2^23 + (b + 128), its mantissa
    holding b ^ 0x80 = b + 128 as an unsigned byte (docs/QUANTIZATION.md, "Kernels")."""
    bits = w.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x4B000080
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@jit
def _skinny_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, stride_wn, stride_sn,
                        HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                        SCALE: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """SCALE: 0 none (W in x's dtype), 1 one per row, 2 one per GROUP columns of a row."""
    grid_wait(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < N
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k + cols
        k_ok = ks < K                 # x is a few KB from L2: masked always; W only if it must
        if EVEN_K:
            w = tl.load(w_ptrs + k, mask=row_ok, other=0.0)
        else:
            w = tl.load(w_ptrs + k, mask=row_ok & k_ok[None, :], other=0.0)
        if w_ptr.dtype.element_ty == tl.int8:
            w = int8_to_float(w)
        else:
            w = w.to(tl.float32)
        if SCALE == 2:                # a few hundred bytes per program: from L1/L2
            s_ptrs = scale_ptr + rows[:, None] * stride_sn + (ks // GROUP)[None, :]
            w *= tl.load(s_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        x = _load_x(x_ptr, ks, K, k_ok, SILU_MUL, x_ptr.dtype.element_ty)
        acc += w * x.to(tl.float32)[None, :]
    launch_next(USE_PDL)          # NOTE: after the loop, not first: docs/ARCHITECTURE.md, PDL
    y = tl.sum(acc, 1)
    if SCALE == 1:
        y *= tl.load(scale_ptr + rows * stride_sn, mask=rows < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def tiling(n: int, k: int, weight_bytes: int = 2, silu_mul: bool = False,
           sms: int = 132) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for an [N, K] weight of weight_bytes a value: 8 rows a program, or 4
    where 8 would leave fewer than two programs per SM (N < 16 x SMs), and _STAGE_BYTES of W a
    stage (twice that with silu_mul, whose x is two loads and the activation per column); from
    a sweep on an H200 (docs/ARCHITECTURE.md, "Skinny GEMM")."""
    block_n = 8 if n >= 16 * sms else 4
    stage = _STAGE_BYTES * (2 if silu_mul else 1)
    block_k = min(stage // (block_n * weight_bytes), max(16, next_pow2(k)))
    return block_n, block_k


QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether skinny_gemm takes this product (the caller falls back to F.linear otherwise)."""
    if not (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16)
            and x.stride(-1) == 1 and weight.dim() == 2 and weight.stride(1) == 1):
        return False
    if scale is None:
        return x.dtype == weight.dtype
    return weight.dtype in QUANT_DTYPES and scale_fits(weight, scale)


def scale_fits(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """scale is float32 [N, G], contiguous, with G dividing K (G = 1: one scale per row)."""
    n, k = weight.shape
    return (scale.dtype == torch.float32 and scale.dim() == 2 and scale.shape[0] == n
            and scale.shape[1] >= 1 and k % scale.shape[1] == 0 and scale.is_contiguous())


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu_mul: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T + bias [N] -> y [1, N], new, in x's dtype.

    silu_mul: x is [1, 2K], gate then up, and y = (silu(gate) * up) @ weight^T + bias.
    scale: weight is int8 or float8_e4m3fn and W = weight * scale (scale float32 [N, G], each
    of the G scales of a row covering K / G consecutive columns).
    No host sync; allocates only y (fine under CUDA graph capture).
    """
    require_triton()
    check(takes(x, weight, scale), f"skinny_gemm takes x [1, K] fp16/bf16 and weight [N, K] of "
          f"x's dtype, or int8/fp8 with a float32 scale [N, G]; unit column strides; got "
          f"{tuple(x.shape)} {x.dtype} strides {x.stride()}, {tuple(weight.shape)} "
          f"{weight.dtype} strides {weight.stride()}"
          + ("" if scale is None else f", scale {tuple(scale.shape)} {scale.dtype}"))
    n, k = weight.shape
    check(x.shape[1] == (2 * k if silu_mul else k), f"x {tuple(x.shape)} for weight "
          f"{tuple(weight.shape)}{' with silu_mul' if silu_mul else ''}")
    if bias is not None:
        check(bias.shape == (n,) and bias.is_contiguous(), f"bias {tuple(bias.shape)}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    groups = 0 if scale is None else scale.shape[1]
    block_n, block_k = tiling(n, k, weight.element_size(), silu_mul, num_sms(x.device))
    _skinny_gemm_kernel[(-(-n // block_n),)](
        x, weight, scale if scale is not None else y, bias if bias is not None else y, y, n, k,
        weight.stride(0), groups, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        EVEN_K=k % block_k == 0, SCALE=0 if groups == 0 else 1 if groups == 1 else 2,
        GROUP=k // groups if groups > 1 else 1, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=_STAGES, num_warps=_WARPS, **pdl_args())
    return y


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    silu_mul: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float32, rounded once (silu(gate) * up rounded first, as above)."""
    if silu_mul:
        x = silu_mul_ref(x)
    w = weight.float() if scale is None else dequantize_ref(weight, scale, torch.float32)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
