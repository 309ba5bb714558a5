"""y = x W^T (+ bias) for a few rows of x (decode): x [M, K] with M <= M_MAX, W [N, K] as
nn.Linear stores it, bf16 or fp16, float32 accumulation. Optionally x is a fused gate/up
projection [M, 2K] and silu(gate) * up is computed while loading it (the MLP's down projection).

Memory-bound: W is read once and x (a few rows) stays in cache, so the kernel is a stream of W.
Program (n, s) computes the [BLOCK_M, BLOCK_N] tile of y at columns n * BLOCK_N over the K range
of split s, BLOCK_K at a time: tl.dot of x's rows (padded to 16, the smallest tensor-core tile)
with W's tile, the loads pipelined num_stages deep.
Split-K: when N alone makes fewer than two tiles per SM, K is split so that enough loads are in
flight. Each split writes a float32 partial to [SPLIT, M, N]; the last split of a tile to finish
(an atomic counter per tile) sums the partials in split order, adds the bias and writes y: one
launch, and the same result whichever split finishes last.

M_MAX = 16: one tensor-core tile of rows holds the whole batch, so W is read exactly once. Past
16 rows a second tile would read W again (or the tiles would grow); cuBLAS takes over there.
Decode CUDA graphs at batch 1, 2, 4, 8 and 16 take this kernel; 24 and up take cuBLAS.
"""
import functools

import torch

from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import check

M_MAX = 16
_BLOCK_M = 16
_BLOCK_K = 128
_MAX_SPLIT = 8
_MAX_TILES = 1024        # per-tile counters kept per device (split-K is for few tiles only)


@jit
def _load_x(x_ptrs, ks, K, mask, SILU_MUL: tl.constexpr, dtype: tl.constexpr):
    """x's [BLOCK_M, BLOCK_K] tile; with SILU_MUL silu(gate) * up of a [M, 2K] gate/up row,
    rounded to the activation dtype as the separate silu_and_mul kernel rounds it."""
    if SILU_MUL:
        gate = tl.load(x_ptrs + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptrs + K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    return tl.load(x_ptrs + ks[None, :], mask=mask, other=0.0)


@jit
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
                        M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                        HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    k_lo = split * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_lo, k_lo + k_per_split, BLOCK_K):
        ks = k + offs_k
        if EVEN_K:                    # K splits into whole blocks: no masks along K
            x = _load_x(x_ptrs, ks, K, m_ok[:, None], SILU_MUL, w_ptr.dtype.element_ty)
            w = tl.load(w_ptrs + ks[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = ks < K
            x = _load_x(x_ptrs, ks, K, m_ok[:, None] & k_ok[None, :], SILU_MUL,
                        w_ptr.dtype.element_ty)
            w = tl.load(w_ptrs + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))                                  # [BLOCK_M, BLOCK_N]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:
        tl.store(part_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                 mask=out_mask)
        # NOTE: CUTLASS's serial split-K pattern: a CTA barrier, then one release/acquire atomic
        # by the CTA, orders every thread's partial before the count the last split reads.
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") != SPLIT - 1:
            return
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT):                               # fixed order
            acc += tl.load(part_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :],
                           mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)                                  # ready for the next launch
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132           # the interpreter: an H100/H200's count, for the same tilings
    return torch.cuda.get_device_properties(device).multi_processor_count


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters, one per tile, that every split-K launch leaves zeroed again.

    NOTE: shared by all launches on the device, which must therefore not run concurrently
    (one stream, as the engine runs). Made on the first split-K call, which the decode graphs'
    warm-up makes before capture.
    """
    if device not in _counters:
        _counters[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _counters[device]


def tiling(n: int, k: int, num_sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, SPLIT, k_per_split) for an [N, K] weight: tiles of 32 columns (64 for LM-head
    sized N), and K split in 2, 4 or 8 until there are two programs per SM, each split at least
    two K blocks."""
    block_n = 64 if n >= 64 * 8 * num_sms else 32
    tiles = -(-n // block_n)
    split = 1
    while (tiles * split < 2 * num_sms and split < _MAX_SPLIT
           and k >= 2 * split * 2 * _BLOCK_K):
        split *= 2
    k_per_split = -(-k // (split * _BLOCK_K)) * _BLOCK_K
    return block_n, split, k_per_split


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_gemm takes this product (the caller falls back to F.linear otherwise)."""
    return (x.dim() == 2 and x.shape[0] <= M_MAX and x.dtype == weight.dtype
            and x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1
            and weight.dim() == 2 and weight.stride(1) == 1)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 16; rows may be strided) @ weight [N, K]^T + bias [N] -> y [M, N], new.

    silu_mul: x is [M, 2K], gate then up, and y = (silu(gate) * up) @ weight^T + bias.
    No host sync; allocates y and, with split-K, an [SPLIT, M, N] float32 workspace (both
    fine under CUDA graph capture).
    """
    require_triton()
    check(takes(x, weight), f"skinny_gemm takes x [M <= {M_MAX}, K] and weight [N, K] of one "
          f"dtype (fp16/bf16), unit column stride; got {tuple(x.shape)} {x.dtype} strides "
          f"{x.stride()}, {tuple(weight.shape)} {weight.dtype} strides {weight.stride()}")
    m = x.shape[0]
    n, k = weight.shape
    check(x.shape[1] == (2 * k if silu_mul else k), f"x {tuple(x.shape)} for weight "
          f"{tuple(weight.shape)}{' with silu_mul' if silu_mul else ''}")
    if bias is not None:
        check(bias.shape == (n,) and bias.is_contiguous(), f"bias {tuple(bias.shape)}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_n, split, k_per_split = tiling(n, k, _num_sms(x.device))
    tiles = -(-n // block_n)
    part = counters = y                                   # unused without split-K
    if split > 1:
        check(tiles <= _MAX_TILES, f"{tiles} tiles")
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device)
    _skinny_gemm_kernel[(tiles, split)](
        x, weight, bias if bias is not None else y, y, part, counters, m, n, k, x.stride(0),
        weight.stride(0), y.stride(0), k_per_split, HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, EVEN_K=k == split * k_per_split, SPLIT=split, BLOCK_M=_BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=_BLOCK_K, num_warps=4, num_stages=4)
    return y


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    silu_mul: bool = False) -> torch.Tensor:
    """The same product in float32, rounded once (silu(gate) * up rounded first, as above)."""
    if silu_mul:
        gate, up = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
