"""W8A16 GEMM: y = x @ (W * scale)^T + bias, x [M, K] bf16/fp16, W [N, K] int8, scale float32
[N, G] (G = 1: one per output row; else one per group of K / G columns, GGUF Q8_0's 32).

A tiled tl.dot kernel: each program owns a [BLOCK_M, BLOCK_N] tile of y and walks K; the int8
tile of W is converted to x's dtype in registers (exact: |q| <= 127 fits bf16's 8 bits) and
fed to the tensor cores with float32 accumulation. Row scales multiply the accumulator once at
the end; group scales multiply the W tile before the conversion (as the reference rounds it).
It reads half the weight bytes of a bf16 GEMM, which is what counts while M is small (decode
batches); single-row decode takes the skinny GEMV (skinny_gemm.py), which streams W faster, and
from CUBLAS_FROM_M rows (prefill) linear() dequantizes W and calls cuBLAS.
"""
import torch

from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import check
from conveyor.kernels.dequantize import dequantize_ref
from conveyor.kernels.skinny_gemm import scale_fits

_GROUP_M = 8        # programs that share W tiles run together (L2 reuse of W across M tiles)
_MIN_PROGRAMS = 256
# NOTE: from this many rows linear() dequantizes the weight to x's dtype (dequantize.py) and
# calls cuBLAS instead: the product is compute bound there, cuBLAS's tuned kernels should beat
# this untuned one, and the dequantization (one pass over W: 3 bytes a value, about 0.1 ms for
# Llama-8B's gate_up) costs a few per cent of the matmul (2.4 ms at 8,192 rows).
# scripts/bench_kernels.py --tables quant times both from 256 rows.
CUBLAS_FROM_M = 1024


@jit
def _int8_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_ym,
                      HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, GROUP: tl.constexpr,
                      EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # out-of-range rows and columns load a valid row again (wrapped); the store drops them
    xm = (rm % M).to(tl.int64)
    wn = (rn % N).to(tl.int64)
    x_ptrs = x_ptr + xm[:, None] * stride_xm + rk[None, :]            # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + wn[None, :] * stride_wn + rk[:, None]            # [BLOCK_K, BLOCK_N] = W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs + k)
            b = tl.load(w_ptrs + k)
        else:
            k_ok = k + rk < K
            a = tl.load(x_ptrs + k, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs + k, mask=k_ok[:, None], other=0)
        if GROUPED:
            s = tl.load(scale_ptr + wn[None, :] * stride_sn + ((k + rk) // GROUP)[:, None],
                        mask=(k + rk < K)[:, None], other=0.0)
            b = (b.to(tl.float32) * s).to(a.dtype)
        else:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc)
    if not GROUPED:
        acc *= tl.load(scale_ptr + wn * stride_sn)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + wn).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def tiling(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): BLOCK_M from the number of rows, a
    long K step while M is small (the weight stream is the cost); BLOCK_N the widest (up to 64,
    or 128 past 64 rows) that still gives _MIN_PROGRAMS programs, so that a decode batch's
    weight is streamed by every SM (an H200 has 132)."""
    if m <= 16:
        block_m, block_k, num_warps, num_stages = 16, 256, 4, 4
    elif m <= 32:
        block_m, block_k, num_warps, num_stages = 32, 128, 4, 4
    elif m <= 64:
        block_m, block_k, num_warps, num_stages = 64, 128, 4, 4
    else:
        block_m, block_k, num_warps, num_stages = 128, 64, 8, 3
    block_n = 32
    for wide in ((128, 64) if m > 64 else (64,)):
        if -(-m // block_m) * -(-n // wide) >= _MIN_PROGRAMS:
            block_n = wide
            break
    return block_m, block_n, block_k, num_warps, num_stages


def takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1
            and weight.dim() == 2 and weight.dtype == torch.int8 and weight.stride(1) == 1
            and x.shape[1] == weight.shape[1] and scale_fits(weight, scale))


def int8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] int8 * scale [N, G])^T + bias [N] -> y [M, N] in x's dtype."""
    require_triton()
    check(takes(x, weight, scale), f"int8_gemm takes x [M, K] fp16/bf16, weight [N, K] int8 and "
          f"scale float32 [N, G] (G dividing K), unit column strides; got x {tuple(x.shape)} "
          f"{x.dtype} strides {x.stride()}, weight {tuple(weight.shape)} {weight.dtype} strides "
          f"{weight.stride()}, scale {tuple(scale.shape)} {scale.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None:
        check(bias.shape == (n,) and bias.is_contiguous(), f"bias {tuple(bias.shape)}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    groups = scale.shape[1]
    block_m, block_n, block_k, num_warps, num_stages = tiling(m, n)
    grid = (-(-m // block_m) * -(-n // block_n),)
    _int8_gemm_kernel[grid](
        x, weight, scale, bias if bias is not None else y, y, m, n, k,
        x.stride(0), weight.stride(0), groups, y.stride(0),
        HAS_BIAS=bias is not None, GROUPED=groups > 1, GROUP=k // groups if groups > 1 else 1,
        EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=_GROUP_M, num_warps=num_warps, num_stages=num_stages)
    return y


def int8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The weight dequantized to x's dtype, then F.linear (also the CPU path)."""
    return torch.nn.functional.linear(x, dequantize_ref(weight, scale, x.dtype), bias)
