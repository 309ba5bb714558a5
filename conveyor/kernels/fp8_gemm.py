"""fp8 W8A8 GEMM: y = (q_x * s_x) @ (W * s_w)^T + bias, W float8_e4m3fn [N, K] with a float32
scale per output row [N, 1], x [M, K] bf16/fp16 quantized per token on the fly (quant_fp8.py),
or given as Fp8Rows (rms_norm(fp8=True)), or the MLP's gate/up output with silu_mul. K and N are
multiples of 16; compute capability 8.9+. Up to TILED_TO_M rows on Hopper the Triton tiles here
run it, else torch._scaled_mm (cuBLASLt, bf16 output). Design and figures: docs/QUANTIZATION.md.
"""
import functools

import torch

from conveyor.kernels._triton import (
    grid_sync,
    jit,
    pdl_args,
    require_triton,
    tl,
    weight_major_tile,
)
from conveyor.kernels._util import Fp8Rows, check, num_sms
from conveyor.kernels.quant_fp8 import MAX_K, quant_fp8, quant_fp8_ref

TILED_TO_M = 256    # rows up to which Hopper takes the Triton tiles; cuBLAS from there


@jit
def _fp8_gemm_kernel(q_ptr, sq_ptr, w_ptr, sw_ptr, bias_ptr, y_ptr, M, N, K, stride_qm,
                     stride_wn, stride_ym, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    rm, rn = weight_major_tile(tl.program_id(0), M, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    q_ptrs = q_ptr + rm[:, None].to(tl.int64) * stride_qm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(q_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = rk[None, :] < K - k
            a = tl.load(q_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)    # W's tile transposed: K-major, as fp8 wgmma wants
        q_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(sq_ptr + rm, mask=m_ok, other=0.0)[:, None]
    acc *= tl.load(sw_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tiling(m: int, n: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for q [m, K] and W [n, K] on a GPU of
    sms SMs: the widest tile that still gives every SM a program (docs/QUANTIZATION.md). NOTE:
    two warpgroups is the shape Triton 3.6 miscompiled for int8_gemm's bf16 dots; the GPU tests
    check it here at Llama's sizes."""
    if m > 64 and programs(m, n, 128, 128) >= sms:
        return 128, 128, 128, 8, 3
    if programs(m, n, 64, 128) >= sms:
        return 64, 128, 128, 4, 4
    if programs(m, n, 64, 64) >= sms:
        return 64, 64, 256, 4, 3
    return 64, 32, 256, 4, 4


def programs(m: int, n: int, block_m: int, block_n: int) -> int:
    """The kernel's grid: one program per BLOCK_M x BLOCK_N tile of y [m, n]."""
    return -(-m // block_m) * -(-n // block_n)


@functools.cache
def _tiled_on(device: torch.device) -> int:
    """The SM count where the Triton tiles run (Hopper), else 0."""
    return num_sms(device) if torch.cuda.get_device_capability(device)[0] == 9 else 0


def supported(device: torch.device) -> bool:
    """Whether the device has fp8 tensor cores (compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def takes(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor,
          silu_mul: bool = False) -> bool:
    """Whether fp8_gemm takes this product; x may be Fp8Rows (never with silu_mul)."""
    n, k = weight.shape
    if isinstance(x, Fp8Rows):
        x_ok = (x.q.dtype == torch.float8_e4m3fn and x.shape[-1] == k and not silu_mul
                and x.scale.shape == (x.shape[0], 1) and x.scale.dtype == torch.float32
                and x.scale.is_contiguous())
        x = x.q
    else:
        x_ok = (x.dtype in (torch.float16, torch.bfloat16)
                and x.shape[-1] == (2 * k if silu_mul else k))
    return (x_ok and x.is_cuda and x.dim() == 2 and x.stride(-1) == 1
            and weight.dtype == torch.float8_e4m3fn
            and weight.is_contiguous() and k % 16 == 0 and n % 16 == 0 and k <= MAX_K
            and scale.shape == (n, 1) and scale.dtype == torch.float32 and scale.is_contiguous())


def fp8_gemm(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * scale [N, 1])^T + bias [N] -> y [M, N] in x's dtype.

    x: a tensor, or Fp8Rows quantized for this layer (rms_norm(fp8=True)).
    silu_mul: x is [M, 2K], gate then up, and the product is of silu(gate) * up."""
    check(takes(x, weight, scale, silu_mul), f"fp8_gemm takes x [M, K] fp16/bf16 on CUDA "
          f"([M, 2K] with silu_mul) or Fp8Rows [M, K] (without), weight [N, K] float8_e4m3fn "
          f"contiguous with K, N multiples of 16 (K at most {MAX_K}) and scale float32 [N, 1]; "
          f"got x {tuple(x.shape)} {x.q.dtype if isinstance(x, Fp8Rows) else x.dtype}"
          f"{' with silu_mul' if silu_mul else ''}, weight {tuple(weight.shape)} "
          f"{weight.dtype}, scale {tuple(scale.shape)} {scale.dtype}")
    if bias is not None:
        check(bias.shape == (weight.shape[0],) and bias.is_contiguous(),
              f"bias {tuple(bias.shape)} for weight {tuple(weight.shape)}")
    rows = x if isinstance(x, Fp8Rows) else Fp8Rows(*quant_fp8(x, silu_mul), x.dtype)
    m, n = rows.shape[0], weight.shape[0]
    if m == 0:
        return rows.q.new_empty(0, n, dtype=rows.dtype)
    sms = _tiled_on(rows.q.device)
    if m <= TILED_TO_M and sms:
        return tiled(rows, weight, scale, bias, tiling(m, n, sms))
    y = torch._scaled_mm(rows.q, weight.t(), scale_a=rows.scale, scale_b=scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    if bias is not None:      # in float32: the bf16 output is rounded once already
        return (y.float() + bias.float()).to(rows.dtype)
    return y.to(rows.dtype)


def tiled(rows: Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
          tiles: tuple[int, int, int, int, int]) -> torch.Tensor:
    """The Triton kernel's product of rows and weight * scale (+ bias) with the given tiling;
    fp8_gemm checks the operands."""
    require_triton()
    (m, k), n = rows.shape, weight.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tiles
    y = torch.empty(m, n, dtype=rows.dtype, device=rows.q.device)
    _fp8_gemm_kernel[(programs(m, n, block_m, block_n),)](
        rows.q, rows.scale, weight, scale, bias if bias is not None else y, y, m, n, k,
        rows.q.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_args())
    return y


def fp8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same arithmetic in float32: x rounded to fp8 per token as the kernel does, both
    operands scaled back, one matmul, rounded once (also the CPU path of fp8 models)."""
    q, s = quant_fp8_ref(x)
    y = (q.float() * s) @ (weight.float() * scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
