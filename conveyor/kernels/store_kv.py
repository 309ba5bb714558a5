"""Write this step's K and V into the paged pool at their slots; slot -1 (padding) is skipped.
The pool of one layer is [num_blocks, 2, block_size, kv_heads, head_dim] (0 = K, 1 = V); slot s
lands in block s // block_size at offset s % block_size. One program per token, no host sync.
An fp8 pool (float8 e4m3) stores k * (1 / k_scale) and v * (1 / v_scale), computed in float32
and clamped to +-448 before the cast (saturating, as the torch reference does).
"""
import torch

from conveyor.kernels._triton import grid_sync, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import FP8_MAX, check, next_pow2


@jit
def to_cache(x, inv_scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    """Values in the model's dtype as the pool stores them: as they are, or for an fp8 pool
    times 1 / scale in float32, clamped to +-FP8_MAX, cast."""
    if FP8:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
    return x.to(dtype)


@jit
def store_heads(src, stride_h, dst, stride_dh, inv_scale, KV_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """One token's heads [KV_HEADS, HEAD_DIM] from src to their place in the pool at dst."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(src + h[:, None] * stride_h + d[None, :], mask=mask)
    tl.store(dst + h[:, None] * stride_dh + d[None, :],
             to_cache(x, inv_scale, FP8, FP8_MAX, dst.dtype.element_ty), mask=mask)


@jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_inv_scale, v_inv_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ckv, stride_cs, stride_ch,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8: tl.constexpr,
                     FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
        store_heads(k_ptr + t * stride_kt, stride_kh, dst, stride_ch, k_inv_scale,
                    KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, FP8, FP8_MAX)
        store_heads(v_ptr + t * stride_vt, stride_vh, dst + stride_ckv, stride_ch, v_inv_scale,
                    KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, FP8, FP8_MAX)


def check_store(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Checks store_kv's arguments (also rotary_qk's when it stores K and V); True for an fp8
    pool."""
    t, kvh, d = k.shape
    check(v.shape == k.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    check(kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[3:] == (kvh, d),
          f"kv_cache {tuple(kv_cache.shape)} is not [blocks, 2, block_size, {kvh}, {d}]")
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    check(k.dtype == v.dtype and (fp8 or k.dtype == kv_cache.dtype),
          f"dtypes differ: k {k.dtype}, v {v.dtype}, cache {kv_cache.dtype}")
    check(fp8 or k_scale == v_scale == 1.0, f"scales {k_scale}, {v_scale} need an fp8 cache")
    check(k_scale > 0 and v_scale > 0, f"scales must be positive, got {k_scale}, {v_scale}")
    check(k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1,
          "the head_dim axis must be contiguous")
    check(slot_mapping.shape[0] >= t and slot_mapping.dtype in (torch.int32, torch.int64),
          f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype} for {t} tokens")
    check(k.device == v.device == kv_cache.device == slot_mapping.device, "devices differ")
    return fp8


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v [T, kv_heads, head_dim] (any token/head strides, unit dim stride) -> kv_cache.

    kv_cache is k's dtype, or float8_e4m3fn (then K and V are stored divided by their scales).
    """
    require_triton()
    t, kvh, d = k.shape
    fp8 = check_store(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, kv_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        KV_HEADS=kvh, HEAD_DIM=d, BLOCK_H=next_pow2(kvh), BLOCK_D=next_pow2(d),
        PAGE_SIZE=kv_cache.shape[2], FP8=fp8, FP8_MAX=FP8_MAX, num_warps=4, **pdl_args())


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The torch reference (the CPU backend's write_kv)."""
    from conveyor.worker.attention_backend import TorchAttentionBackend

    TorchAttentionBackend().write_kv(kv_cache, k, v, slot_mapping[:k.shape[0]], k_scale,
                                     v_scale)
