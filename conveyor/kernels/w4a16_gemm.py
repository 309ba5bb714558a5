"""W4A16: y = x W^T with W in 4 bits, dequantized in the kernel's registers.

The layout every 4-bit checkpoint (AWQ, GPTQ) is converted to at load (worker/int4_checkpoint.py):
  qweight int32 [N, K / 8]: value k of row n in bits 4 (k % 8) of qweight[n, k // 8] (0..15);
  scale, zero float32 [N, G]: W[n, k] = (q - zero[n, g]) * scale[n, g], g = k // (K / G);
  perm int64 [K] or None: GPTQ act-order, the input columns in group order (x[:, perm] is the
  layer's input in the weight's column order).
`dequantize_int4` is the reference and the CPU path (dequantize, then F.linear); `w4a16_gemm` is
the Triton kernel: each program takes a tile of y, and for each K step loads BLOCK_K / 8 int32
words per weight row, unpacks their nibbles with shifts, subtracts the group's zero, multiplies
by its scale in float32, and feeds the tile, in x's dtype, to the tensor cores. Weight tiles
never go back to memory, so a decode step reads half a byte per weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import check, num_sms


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] -> the 4-bit values [N, K] as uint8 (0..15), in k order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight[:, :, None] >> shifts) & 15).to(torch.uint8).reshape(qweight.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The 4-bit values [N, K] (0..15) -> int32 [N, K / 8], value k in bits 4 (k % 8)."""
    n, k = q.shape
    check(k % 8 == 0, f"K must be a multiple of 8, got {k}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (q.to(torch.int64).reshape(n, k // 8, 8) << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def dequantize_int4(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in dtype: (q - zero) * scale per group, computed in float32."""
    q = unpack_int4(qweight).float()                            # [N, K]
    n, k = q.shape
    g = scale.shape[1]
    q = q.view(n, g, k // g)
    return ((q - zero[:, :, None]) * scale[:, :, None]).view(n, k).to(dtype)


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              bias: torch.Tensor | None = None, perm: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The reference (and the CPU path): dequantize, then one matmul in x's dtype."""
    if perm is not None:
        x = x[:, perm]
    return F.linear(x, dequantize_int4(qweight, scale, zero, x.dtype), bias)


@jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, GROUP,
                  stride_xm, stride_wn, stride_sn, stride_ym, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    word = offs_k // 8                                        # [BK] word of each k
    shift = (offs_k % 8) * 4                                  # [BK] its nibble
    rows_n = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)           # [BM, BK]
        words = tl.load(w_ptr + rows_n[None, :] * stride_wn + (k0 // 8 + word)[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0)        # [BK, BN]
        q = ((words >> shift[:, None]) & 15).to(tl.float32)
        g = (k0 + offs_k) // GROUP                                           # [BK]
        s_off = rows_n[None, :] * stride_sn + g[:, None]
        s = tl.load(s_ptr + s_off, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        z = tl.load(z_ptr + s_off, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w = ((q - z) * s).to(x.dtype)                                        # [BK, BN]
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int, n: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the number of rows. Decode-sized batches take
    narrower weight tiles where wide ones would leave SMs idle (4,096 rows in tiles of 64 are 64
    programs for 132 SMs): a choice by arithmetic, not yet by measurement."""
    if m <= 16:
        bn = next((b for b in (64, 32) if -(-n // b) >= 2 * sms), 16)
        return 16, bn, 128, 4
    if m <= 64:
        return 64, 64, 64, 4
    # NOTE: BLOCK_K 32: the words, scales and zeros are loaded per k ([BK, BN] each), so three
    # stages of 128 x 128 x 64 tiles need 256 KiB of shared memory (232 KiB on an H100/H200)
    return 128, 128, 32, 8


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               bias: torch.Tensor | None = None, perm: torch.Tensor | None = None
               ) -> torch.Tensor:
    """y [M, N] = x [M, K] W^T (+ bias), W in the 4-bit layout of the module docstring."""
    require_triton()
    if perm is not None:
        x = x[:, perm]
    m, k = x.shape
    n = qweight.shape[0]
    g = scale.shape[1]
    check(qweight.dtype == torch.int32 and qweight.shape == (n, k // 8) and k % 8 == 0,
          f"qweight {qweight.dtype} {tuple(qweight.shape)} for x {tuple(x.shape)}")
    check(scale.shape == zero.shape == (n, g) and k % g == 0 and (k // g) % 8 == 0
          and scale.dtype == zero.dtype == torch.float32,
          f"scale and zero must be float32 [N, G] with K / G a multiple of 8: "
          f"{tuple(scale.shape)}, {tuple(zero.shape)}")
    check(x.dtype in (torch.float16, torch.bfloat16), f"x must be fp16 or bf16, got {x.dtype}")
    x = x.contiguous()
    check(qweight.is_contiguous() and scale.is_contiguous() and zero.is_contiguous(),
          "qweight, scale and zero must be contiguous")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps = _tiles(m, n, num_sms(x.device))
    grid = (-(-n // bn), -(-m // bm))
    _w4a16_kernel[grid](x, qweight, scale, zero, bias if bias is not None else y, y, m, n, k,
                        k // g, x.stride(0), qweight.stride(0), scale.stride(0), y.stride(0),
                        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                        num_warps=warps, num_stages=3)
    return y
