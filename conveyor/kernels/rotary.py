"""Rotary embedding ("rotate half", neox style) of q and k in place, with Qwen3's per-head
RMSNorm of q and k optionally fused in front of it (one pass over q and k instead of four).

q [T, heads, head_dim] and k [T, kv_heads, head_dim] may be strided views of the fused qkv
projection's output; cos/sin [T, head_dim / 2] float32 (already looked up by position).
One program per token, all its heads.
"""
import torch

from conveyor.kernels._triton import grid_sync, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import check, next_pow2


@jit
def _rotate_heads(base, stride_h, num_heads, w_ptr, cos, sin, eps,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  QK_NORM: tl.constexpr):
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
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(p1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   QK_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + t * stride_ct + j, mask=j < HALF, other=0.0)
    sin = tl.load(sin_ptr + t * stride_st + j, mask=j < HALF, other=0.0)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, Q_HEADS, qw_ptr, cos, sin, eps,
                  HALF, BLOCK_QH, BLOCK_HALF, QK_NORM)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, K_HEADS, kw_ptr, cos, sin, eps,
                  HALF, BLOCK_KH, BLOCK_HALF, QK_NORM)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_norm_weight: torch.Tensor | None = None,
              k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """Rotate q [T, heads, d] and k [T, kv_heads, d] in place (after the q/k norm, if given)."""
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
    if t == 0:
        return
    qw = q_norm_weight if norm else cos
    kw = k_norm_weight if norm else cos
    _rotary_kernel[(t,)](q, k, cos, sin, qw, kw, eps,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cos.stride(0), sin.stride(0),
                         Q_HEADS=heads, K_HEADS=k.shape[1], HALF=d // 2,
                         BLOCK_QH=next_pow2(heads), BLOCK_KH=next_pow2(k.shape[1]),
                         BLOCK_HALF=next_pow2(d // 2), QK_NORM=norm, num_warps=4,
                         **pdl_args())


def rotary_qk_ref(q, k, cos, sin, q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    """The torch layers' math; returns new (q, k)."""
    from conveyor.kernels.rms_norm import rms_norm_ref
    from conveyor.worker.layers.rotary import apply_rotary

    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
        k = rms_norm_ref(k, k_norm_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
