"""Rotary embedding ("rotate half", neox style) of q and k in place, with Qwen3's per-head
RMSNorm of q and k optionally fused in front of it (one pass over q and k instead of four).
Given the layer's KV pool, it also writes the rotated k and v there at their slots, as store_kv
would (then k is not written back): one kernel instead of two in every layer.

q [T, heads, head_dim] and k [T, kv_heads, head_dim] may be strided views of the fused qkv
projection's output; cos/sin [T, head_dim / 2] float32 (already looked up by position).
One program per token, all its heads.
"""
import torch

from conveyor.kernels._triton import grid_sync, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import FP8_MAX, check, next_pow2
from conveyor.kernels.store_kv import check_store, store_heads, to_cache


@jit
def _rotate_heads(base, stride_h, out, stride_oh, num_heads, w_ptr, cos, sin, eps, inv_scale,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  QK_NORM: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    mask = (h < num_heads)[:, None] & j_ok[None, :]
    p1 = base + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
    r1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    r2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    o1 = out + h[:, None] * stride_oh + j[None, :]
    tl.store(o1, to_cache(r1, inv_scale, FP8, FP8_MAX, out.dtype.element_ty), mask=mask)
    tl.store(o1 + HALF, to_cache(r2, inv_scale, FP8, FP8_MAX, out.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
                   cache_ptr, slot_ptr, k_inv_scale, v_inv_scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_ct, stride_st, stride_cb, stride_ckv, stride_cs, stride_ch,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   QK_NORM: tl.constexpr, STORE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   FP8: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + t * stride_ct + j, mask=j < HALF, other=0.0)
    sin = tl.load(sin_ptr + t * stride_st + j, mask=j < HALF, other=0.0)
    q = q_ptr + t * stride_qt
    _rotate_heads(q, stride_qh, q, stride_qh, Q_HEADS, qw_ptr, cos, sin, eps, 1.0,
                  HALF, BLOCK_QH, BLOCK_HALF, QK_NORM, False, FP8_MAX)
    k = k_ptr + t * stride_kt
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:                                  # -1: a padding row, nothing stored
            dst = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
            _rotate_heads(k, stride_kh, dst, stride_ch, K_HEADS, kw_ptr, cos, sin, eps,
                          k_inv_scale, HALF, BLOCK_KH, BLOCK_HALF, QK_NORM, FP8, FP8_MAX)
            store_heads(v_ptr + t * stride_vt, stride_vh, dst + stride_ckv, stride_ch,
                        v_inv_scale, K_HEADS, 2 * HALF, BLOCK_KH, 2 * BLOCK_HALF, FP8, FP8_MAX)
    else:
        _rotate_heads(k, stride_kh, k, stride_kh, K_HEADS, kw_ptr, cos, sin, eps, 1.0,
                      HALF, BLOCK_KH, BLOCK_HALF, QK_NORM, False, FP8_MAX)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_norm_weight: torch.Tensor | None = None,
              k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
              v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
              slot_mapping: torch.Tensor | None = None, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
    """Rotate q [T, heads, d] and k [T, kv_heads, d] in place (after the q/k norm, if given).

    With v [T, kv_heads, d], kv_cache and slot_mapping: store the rotated k and v into the pool
    as store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale) would, instead of writing k
    back (k is left as it was)."""
    require_triton()
    check(q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2],
          f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, d]")
    t, heads, d = q.shape
    check(d % 2 == 0 and cos.shape == sin.shape == (t, d // 2), f"cos/sin {tuple(cos.shape)} "
          f"for {t} tokens of head_dim {d}")
    check(cos.dtype == sin.dtype == torch.float32 and cos.stride(1) == sin.stride(1) == 1,
          "cos/sin must be float32 with contiguous rows")
    check(q.dtype == k.dtype and q.stride(2) == 1 and k.stride(2) == 1,
          "q and k must share a dtype and have a contiguous head_dim axis")
    norm = q_norm_weight is not None
    check(norm == (k_norm_weight is not None), "give both q and k norm weights or neither")
    if norm:
        check(q_norm_weight.shape == k_norm_weight.shape == (d,), "norm weights must be [d]")
    store = kv_cache is not None
    check(store == (v is not None) == (slot_mapping is not None),
          "give v, kv_cache and slot_mapping together, or none of them")
    fp8 = store and check_store(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    if t == 0:
        return
    qw = q_norm_weight if norm else cos
    kw = k_norm_weight if norm else cos
    cache, slots, vv = (kv_cache, slot_mapping, v) if store else (q, cos, k)
    _rotary_kernel[(t,)](q, k, vv, cos, sin, qw, kw, eps, cache, slots,
                         1.0 / k_scale, 1.0 / v_scale,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         vv.stride(0), vv.stride(1), cos.stride(0), sin.stride(0),
                         *(cache.stride()[:4] if store else (0, 0, 0, 0)),
                         Q_HEADS=heads, K_HEADS=k.shape[1], HALF=d // 2,
                         BLOCK_QH=next_pow2(heads), BLOCK_KH=next_pow2(k.shape[1]),
                         BLOCK_HALF=next_pow2(d // 2), QK_NORM=norm, STORE=store,
                         PAGE_SIZE=kv_cache.shape[2] if store else 1, FP8=fp8,
                         FP8_MAX=FP8_MAX, num_warps=4, **pdl_args())


def rotary_qk_ref(q, k, cos, sin, q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    """The torch layers' math; returns new (q, k)."""
    from conveyor.kernels.rms_norm import rms_norm_ref
    from conveyor.worker.layers.rotary import apply_rotary

    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
        k = rms_norm_ref(k, k_norm_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
