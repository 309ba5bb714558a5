"""Batched multi-LoRA: y += (x A_s^T) B_s^T for every token, with s its adapter's device slot.

One step mixes tokens of several adapters and of the base model. The host groups the step's
tokens by slot (`group_by_slot`): `order` lists the token rows of slot 0, then slot 1, ...;
`starts[s]:starts[s + 1]` is slot s's run of it; tokens of no adapter are left out. A program
takes BLOCK_M rows of one slot's run, so prefill chunks become tiles of contiguous rows of one
adapter (SGMV's segments) and decode tokens are gathered row by row into their adapter's tiles
(BGMV's per-token gather); either way one adapter's A or B tile feeds a tensor-core dot for all
the rows. Grids are sized from the token count and the slot count only, so a CUDA graph
captures them: programs past their slot's run return at once.

- shrink: h[t, i] = x[t] A[s, i]^T, h float32 [T, slices, R], A [S, slices, R, K];
- expand: y[t, off_i:off_i + n_i] += h[t, i] B[s, off_i:off_i + n_i]^T, B [S, N, R] (the
  adapter's scale folded in), slice i of the fused layer's output (q, k, v; gate, up). h may
  also hold every slot's shrink, [T, S, slices, R] (any float dtype, rows strided): then token
  t reads its own slot's. That is the shape layers/lora.py gets when the shrink rides the base
  layer's GEMM, A's rows stacked under the weight.
R is the padded rank (a power of two, at least 16: tl.dot's smallest size); padding is zeros.
"""
import torch

from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import check


def group_by_slot(token_slots, num_slots: int):
    """numpy [T] slot per token (-1: none) -> (order [T]: the token rows grouped by slot, then
    the tokens of no slot; starts [num_slots + 1])."""
    import numpy as np

    order = np.argsort(np.where(token_slots < 0, num_slots, token_slots), kind="stable")
    counts = np.bincount(token_slots[token_slots >= 0], minlength=num_slots)
    starts = np.zeros(num_slots + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return order, starts


def lora_ref(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             slice_sizes: list[int], token_slots: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """The torch reference, in place on y [T, N] and returned: token_slots [T] (-1: no
    adapter), `slots` the slots that occur in it. Shrink in float32, as the kernel."""
    h = torch.einsum("tk,sirk->tsir", x.float(), A.float())              # [T, S, slices, R]
    return lora_expand_ref(y, h, B, slice_sizes, token_slots, slots)


def lora_expand_ref(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, slice_sizes: list[int],
                    token_slots: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """The expand's reference, in place on y [T, N]: h [T, S, slices, R], every slot's shrink
    of every token (each token takes its own slot's), rounded to B's dtype as the kernel does."""
    for s in slots:
        rows = (token_slots == s).nonzero().squeeze(1)
        hs = h.index_select(0, rows)[:, s].to(B.dtype).float()            # [rows, slices, R]
        parts, off = [], 0
        for i, n in enumerate(slice_sizes):
            parts.append(hs[:, i] @ B[s, off:off + n].float().T)
            off += n
        y.index_add_(0, rows, torch.cat(parts, dim=1).to(y.dtype))
    return y


@jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, starts_ptr, K, K_SPLIT, stride_x, stride_as,
                   stride_ai, stride_ar, stride_h, NUM_SLICES: tl.constexpr, R: tl.constexpr,
                   SPLIT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid_m, i, pid_sk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, ks = pid_sk // SPLIT, pid_sk % SPLIT
    start = tl.load(starts_ptr + s)
    count = tl.load(starts_ptr + s + 1) - start
    if pid_m * BLOCK_M >= count:
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < count
    rows = tl.load(order_ptr + start + rm, mask=m_ok, other=0).to(tl.int64)
    rr = tl.arange(0, R)
    rk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + s.to(tl.int64) * stride_as + i * stride_ai
    acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    k_end = tl.minimum(K, (ks + 1) * K_SPLIT)
    for k in range(ks * K_SPLIT, k_end, BLOCK_K):
        k_ok = k + rk < k_end
        xt = tl.load(x_ptr + rows[:, None] * stride_x + (k + rk)[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)      # [BLOCK_M, BLOCK_K]
        at = tl.load(a_base + rr[None, :] * stride_ar + (k + rk)[:, None], mask=k_ok[:, None],
                     other=0.0)                                          # [BLOCK_K, R] = A^T
        if IEEE:
            acc = tl.dot(xt, at, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, at, acc)
    h_ptrs = h_ptr + rows[:, None] * stride_h + i * R + rr[None, :]
    if SPLIT == 1:
        tl.store(h_ptrs, acc, mask=m_ok[:, None])
    else:
        tl.atomic_add(h_ptrs, acc, mask=m_ok[:, None])


@jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, offsets_ptr, stride_h, stride_hs,
                   stride_hi, stride_bs, stride_bn, stride_y, NUM_SLICES: tl.constexpr,
                   R: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    pid_m, pid_n, pid_si = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, i = pid_si // NUM_SLICES, pid_si % NUM_SLICES
    start = tl.load(starts_ptr + s)
    count = tl.load(starts_ptr + s + 1) - start
    off = tl.load(offsets_ptr + i)
    size = tl.load(offsets_ptr + i + 1) - off
    if pid_m * BLOCK_M >= count or pid_n * BLOCK_N >= size:
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < count
    rows = tl.load(order_ptr + start + rm, mask=m_ok, other=0).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < size
    cols = off + rn
    rr = tl.arange(0, R)
    h_base = h_ptr + s.to(tl.int64) * stride_hs + i * stride_hi
    ht = tl.load(h_base + rows[:, None] * stride_h + rr[None, :], mask=m_ok[:, None],
                 other=0.0)                                              # [BLOCK_M, R]
    bt = tl.load(b_ptr + s.to(tl.int64) * stride_bs + cols[None, :] * stride_bn + rr[:, None],
                 mask=n_ok[None, :], other=0.0)                          # [R, BLOCK_N] = B^T
    if IEEE:
        delta = tl.dot(ht.to(bt.dtype), bt, input_precision="ieee")
    else:
        delta = tl.dot(ht.to(bt.dtype), bt)
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


# NOTE: output columns of an expand program; 64 beat 128 and 256 on Llama-3.1-8B's four LoRA
# layers at 64 and 256 tokens (H200: 1.34 against 1.48 and 1.38 ms for 32 layers' expands)
EXPAND_BLOCK_N = 64


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 256 else 64


def _split_k(num_tokens: int, k: int, block_k: int) -> int:
    """Parts of K that the shrink of a decode-sized step sums with atomics.

    NOTE: a decode step has few row tiles (T / 16) for a whole weight's K (4,096-14,336), so
    one program per tile would run K / BLOCK_K dependent steps while most SMs idle; parts of
    at most 512 columns spread it. Prefill-sized steps have tiles enough, and keep one part
    (plain stores, no zeroing)."""
    if num_tokens > 256:
        return 1
    return max(1, -(-k // max(512, block_k)))


def lora_shrink(x: torch.Tensor, A: torch.Tensor, order: torch.Tensor,
                starts: torch.Tensor) -> torch.Tensor:
    """h [T, slices, R] float32 (rows of tokens of no adapter are left unset)."""
    require_triton()
    T, K = x.shape
    S, num_slices, R, KA = A.shape
    check(KA == K and x.stride(1) == 1 and A.is_contiguous(), "lora_shrink: bad x or A")
    check(R >= 16 and R & (R - 1) == 0, f"lora_shrink: R must be a power of two >= 16, got {R}")
    check(order.numel() >= T and starts.numel() == S + 1, "lora_shrink: bad order or starts")
    bm, bk = _block_m(T), 64
    split = _split_k(T, K, bk)
    k_split = triton_cdiv(triton_cdiv(K, split), bk) * bk
    h = (torch.zeros if split > 1 else torch.empty)(T, num_slices, R, dtype=torch.float32,
                                                      device=x.device)
    _shrink_kernel[(triton_cdiv(T, bm), num_slices, S * split)](
        x, A, h, order, starts, K, k_split, x.stride(0), A.stride(0), A.stride(1), A.stride(2),
        h.stride(0), NUM_SLICES=num_slices, R=R, SPLIT=split, IEEE=x.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor,
                max_slice: int, order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """y [T, N] += the expand of h, in place; h [T, slices, R] (lora_shrink's) or
    [T, S, slices, R] (every slot's; each token reads its own); offsets [slices + 1] int32 on
    the device (slice i is columns offsets[i]:offsets[i + 1]); max_slice: the widest slice."""
    require_triton()
    T, N = y.shape
    S, NB, R = B.shape
    num_slices = h.shape[-2]
    per_slot = h.dim() == 4
    check(NB == N and y.stride(1) == 1 and B.is_contiguous() and h.stride(-1) == 1
          and h.shape == ((T, S, num_slices, R) if per_slot else (T, num_slices, R)),
          "lora_expand: bad y, h or B")
    check(offsets.numel() == num_slices + 1, "lora_expand: bad offsets")
    bm, bn = _block_m(T), EXPAND_BLOCK_N
    _expand_kernel[(triton_cdiv(T, bm), triton_cdiv(max_slice, bn), S * num_slices)](
        h, B, y, order, starts, offsets, h.stride(0), h.stride(1) if per_slot else 0,
        h.stride(-2), B.stride(0), B.stride(1), y.stride(0),
        NUM_SLICES=num_slices, R=R, IEEE=y.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=4)
    return y


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
