"""W8A16 GEMM: y = x @ (W * scale)^T + bias, x [M, K] bf16/fp16, W [N, K] int8, scale float32
[N, G] (G = 1: one per output row; else one per group of K / G columns, GGUF Q8_0's 32).

A program owns BLOCK_N weight rows by BLOCK_M batch rows and computes y^T = W_tile @ x_tile^T,
so that the int8 tile, converted in registers (int8_to_float, exact), is the register operand of
Hopper's wgmma. Row scales multiply the accumulator at the end, group scales the converted tile.
Where a call has too few tiles, K is split among SPLIT_K programs; the last to finish a tile
adds the float32 partials in split order (the same sum every run) and resets the tile's count.
Design and figures: docs/QUANTIZATION.md.
"""
import torch

from conveyor.kernels._triton import jit, require_triton, split_k_sum, tl, weight_major_tile
from conveyor.kernels._util import check, next_pow2, tile_counts
from conveyor.kernels.dequantize import dequantize_ref
from conveyor.kernels.skinny_gemm import int8_to_float, scale_fits

# NOTE: weight rows a tile: one warpgroup's tensor-core M, with 4 warps. Tiles of 128 rows over
# 8 warps (two warpgroups) came out 2-8 % wrong from Triton 3.6 on an H200 (in a tile sweep).
BLOCK_N = 64
_WAVE = 256            # split K until a call has about this many programs (2 waves of 132 SMs)
_MAX_SPLIT = 4
# NOTE: from this many rows linear() dequantizes the weight to x's dtype (dequantize.py) and
# calls cuBLAS instead: compute bound there, cuBLAS's bf16 kernels beat this one by more than
# the dequantization costs (docs/QUANTIZATION.md; bench_kernels.py --tables quant times both)
CUBLAS_FROM_M = 1024


@jit
def _int8_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                      K_SPLIT, stride_xm, stride_wn, stride_sn, stride_ym,
                      HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, GROUP: tl.constexpr,
                      EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rm, rn = weight_major_tile(tile, M, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # out-of-range rows load a valid row again (wrapped); the store drops them
    wn = (rn % N).to(tl.int64)
    xm = (rm % M).to(tl.int64)
    k0 = split * K_SPLIT
    w_ptrs = w_ptr + wn[:, None] * stride_wn + rk[None, :]            # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + xm[None, :] * stride_xm + rk[:, None]            # [BLOCK_K, BLOCK_M] = x^T
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in tl.range(k0, k0 + K_SPLIT, BLOCK_K):
        if EVEN_K:
            q = tl.load(w_ptrs + k)
            b = tl.load(x_ptrs + k)
        else:
            k_ok = k + rk < K
            q = tl.load(w_ptrs + k, mask=k_ok[None, :], other=0)
            b = tl.load(x_ptrs + k, mask=k_ok[:, None], other=0.0)
        a = int8_to_float(q)
        if GROUPED:
            a *= tl.load(scale_ptr + wn[:, None] * stride_sn + ((k + rk) // GROUP)[None, :],
                         mask=(k + rk < K)[None, :], other=0.0)
        acc = tl.dot(a.to(b.dtype), b, acc)
    offs = rm[None, :].to(tl.int64) * N + rn[:, None]                  # y^T tile, dense [M, N]
    mask = (rm[None, :] < M) & (rn[:, None] < N)
    last = True
    if SPLIT_K > 1:
        acc, last = split_k_sum(acc, part_ptr, count_ptr, tile, split, offs, mask, M * N, SPLIT_K)
    if not GROUPED:
        acc *= tl.load(scale_ptr + wn * stride_sn)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + wn).to(tl.float32)[:, None]
    y_ptrs = y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask & last)


def tiling(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps, num_stages, SPLIT_K) for x [m, k] and W [n, k]; BLOCK_N is
    64. BLOCK_M covers the batch up to 128 rows (256 on a weight of 264 or more tiles, Llama's
    gate_up), and K is split in two or four while the call has fewer than _WAVE programs; from
    a sweep on an H200."""
    n_tiles = -(-n // BLOCK_N)
    block_m = min(max(next_pow2(m), 16), 256 if m > 128 and n_tiles >= 264 else 128)
    block_k, num_stages = (64, 3) if block_m == 256 else (128, 4 if block_m <= 64 else 3)
    programs = n_tiles * -(-m // block_m)
    split = 1
    while (split < _MAX_SPLIT and programs * split * 2 <= _WAVE
           and k % (split * 2 * block_k) == 0):
        split *= 2
    return block_m, block_k, 4, num_stages, split


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
    block_m, block_k, num_warps, num_stages, split = tiling(m, n, k)
    tiles = -(-m // block_m) * -(-n // BLOCK_N)
    part = counts = y
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counts = tile_counts(x.device, tiles, "int8_gemm")
    _int8_gemm_kernel[(tiles, split)](
        x, weight, scale, bias if bias is not None else y, y, part, counts, m, n, k, k // split,
        x.stride(0), weight.stride(0), groups, y.stride(0),
        HAS_BIAS=bias is not None, GROUPED=groups > 1, GROUP=k // groups if groups > 1 else 1,
        EVEN_K=k % block_k == 0, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return y


def int8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The weight dequantized to x's dtype, then F.linear (also the CPU path)."""
    return torch.nn.functional.linear(x, dequantize_ref(weight, scale, x.dtype), bias)
