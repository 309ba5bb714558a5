"""W4A16: y = x W^T with W in 4 bits, dequantized in the kernel's registers.

The layout every 4-bit checkpoint (AWQ, GPTQ) is converted to at load (worker/int4_checkpoint.py):
  qweight int32 [N, K / 8]: value k of row n in bits 4 (k % 8) of qweight[n, k // 8] (0..15);
  scale, zero float32 [N, G]: W[n, k] = (q - zero[n, g]) * scale[n, g], g = k // (K / G);
  perm int64 [K] or None: GPTQ act-order, the input columns in group order (x[:, perm] is the
  layer's input in the weight's column order).
`dequantize_int4` is the reference and the CPU path (dequantize, then F.linear). `w4a16_gemm`
takes one of two Triton paths by the number of rows M:
  M < CUBLAS_FROM_M (decode): tiles of y; each K step loads BLOCK_K / 8 consecutive words of
  each weight row (coalesced), unpacks them in registers and feeds the tensor cores, the weight
  tile never going back to memory;
  more rows: the weight dequantized to x's dtype in one pass, then cuBLAS (the pass costs about
  as much as reading a bf16 weight once, which a prefill-sized product amortizes).
Both subtract the group's zero and multiply by its scale in float32, and take a nibble to
float by OR-ing it into the mantissa of 2^23 (exact, and no I2F).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import check

# rows from which the weight is dequantized to x's dtype and multiplied by cuBLAS (the tiled
# kernel's dequantization per tile costs more than the one pass once a step has this many rows)
CUBLAS_FROM_M = 32


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


@jit
def _nibbles_as_float(words, shifts):
    """int32 words [R, W] -> their 8 nibbles [R, W, 8] as float32 plus 2^23: OR-ing a nibble
    into the mantissa of 2^23 is exact and avoids I2F (a quarter-rate op on Hopper)."""
    bits = ((words[:, :, None] >> shifts[None, None, :]) & 15) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, GROUP,
                  stride_xm, stride_wn, stride_sn, stride_ym, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile of y; each K step loads BLOCK_K / 8 consecutive words of each
    weight row, and BLOCK_K divides the group, so one scale and zero per row serve the step."""
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    shifts = tl.arange(0, 8) * 4
    rows_n = offs_n.to(tl.int64)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)               # [BM, BK]
        words = tl.load(w_ptrs + k0 // 8, mask=n_ok[:, None], other=0)       # [BN, BK / 8]
        g = k0 // GROUP
        s = tl.load(s_ptr + rows_n * stride_sn + g, mask=n_ok, other=0.0)    # [BN]
        z = tl.load(z_ptr + rows_n * stride_sn + g, mask=n_ok, other=0.0) + 8388608.0
        q = tl.reshape(_nibbles_as_float(words, shifts), (BLOCK_N, BLOCK_K))  # k = 8 word + i
        w = ((q - z[:, None]) * s[:, None]).to(x.dtype)                      # [BN, BK]
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@jit
def _dequantize_int4_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, GROUP, stride_wn, stride_sn,
                            stride_on, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """W [N, K] in out's dtype, BLOCK_N rows by BLOCK_W words (8 BLOCK_W columns) a program."""
    rows_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    kw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    nib = tl.arange(0, 8)
    ok = (rows_n < N)[:, None] & (kw < K // 8)[None, :]
    words = tl.load(w_ptr + rows_n[:, None] * stride_wn + kw[None, :], mask=ok, other=0)
    g = (kw * 8) // GROUP                                      # a word lies in one group
    s = tl.load(s_ptr + rows_n[:, None] * stride_sn + g[None, :], mask=ok, other=0.0)
    z = tl.load(z_ptr + rows_n[:, None] * stride_sn + g[None, :], mask=ok, other=0.0) + 8388608.0
    w = (_nibbles_as_float(words, nib * 4) - z[:, :, None]) * s[:, :, None]   # [BN, BW, 8]
    ks = kw[:, None] * 8 + nib[None, :]
    tl.store(out_ptr + rows_n[:, None, None] * stride_on + ks[None, :, :],
             w.to(out_ptr.dtype.element_ty), mask=ok[:, :, None])


def _tiles(m: int, group: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) below CUBLAS_FROM_M rows; BLOCK_K
    divides the group. From a sweep on an H200 (Llama-3.1-8B's four layer shapes,
    docs/QUANTIZATION.md): narrow weight tiles, so that even 4,096 rows make 256 programs."""
    bk = next(b for b in (128, 64, 32, 16) if group % b == 0)
    return (16, 16, bk, 2, 4) if m <= 16 else (32, 32, bk, 4, 4)


def takes(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the kernels run this layer: fp16/bf16 input and groups of a multiple of 16
    inputs (a tile's K steps stay inside one group); others dequantize, then matmul."""
    k = qweight.shape[1] * 8
    return x.dtype in (torch.float16, torch.bfloat16) and (k // scale.shape[1]) % 16 == 0


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
    check(scale.shape == zero.shape == (n, g) and k % g == 0 and (k // g) % 16 == 0
          and scale.dtype == zero.dtype == torch.float32,
          f"scale and zero must be float32 [N, G] with K / G a multiple of 16: "
          f"{tuple(scale.shape)}, {tuple(zero.shape)}")
    check(x.dtype in (torch.float16, torch.bfloat16), f"x must be fp16 or bf16, got {x.dtype}")
    x = x.contiguous()
    check(qweight.is_contiguous() and scale.is_contiguous() and zero.is_contiguous(),
          "qweight, scale and zero must be contiguous")
    if m >= CUBLAS_FROM_M:
        return F.linear(x, dequantize_int4_gpu(qweight, scale, zero, x.dtype), bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps, stages = _tiles(m, k // g)
    grid = (-(-n // bn), -(-m // bm))
    _w4a16_kernel[grid](x, qweight, scale, zero, bias if bias is not None else y, y, m, n, k,
                        k // g, x.stride(0), qweight.stride(0), scale.stride(0), y.stride(0),
                        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                        num_warps=warps, num_stages=stages)
    return y


def dequantize_int4_gpu(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int4 in one Triton pass: W [N, K] in dtype, new."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    if n and k:
        _dequantize_int4_kernel[(-(-n // 16), -(-k // 8 // 64))](
            qweight, scale, zero, out, n, k, k // scale.shape[1], qweight.stride(0),
            scale.stride(0), out.stride(0), BLOCK_N=16, BLOCK_W=64, num_warps=4)
    return out
