"""Paged attention for a mixed batch (decodes and prefill chunks with cached prefixes) in one
launch, over block tables. The torch reference is TorchAttentionBackend.forward.

q [T, heads, head_dim] is flat over the batch: sequence i owns rows query_start_loc[i] to
query_start_loc[i + 1], the last q_len positions of its seq_lens[i]-token context (causal). The
pool is [num_blocks, 2, block_size, kv_heads, head_dim], in q's dtype or float8 e4m3. A program
takes one KV head over a tile of one sequence's query tokens, a row per (token, query head of
the group); sequence i owns tiles query_start_loc[i] // TQ + i onwards (no host-side tile map).
Split-KV programs write partial outputs and base-2 log-sum-exps, which a second kernel merges.
Per layer, a sliding window (a query sees its last `window` positions; the KV blocks before the
tile's first query's window are not read at all) or chunked attention (Llama 4's: a query sees
the positions of its own `chunk`-aligned chunk up to itself), logit soft-capping (Gemma 2),
and attention sinks (gpt-oss: a logit per head in each softmax's denominator, which the online
softmax starts from as a key of value 0; in split-KV, in split 0's partial only).
Design and figures: docs/ARCHITECTURE.md, "Paged attention" and "fp8 KV cache".
"""
import functools

import torch

from conveyor.kernels._triton import grid_sync, interpreting, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import check, next_pow2

_LOG2E = 1.4426950408889634


@jit
def _e4m3_to_f16(x):
    """x (float8 e4m3) as fp16, exactly; opaque to Triton, so it converts where it is written."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2;"
        " cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, TQ: tl.constexpr):
    """The largest i with query_start_loc[i] // TQ + i <= tile."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first = tl.load(query_start_loc_ptr + mid) // TQ + mid
        if first <= tile:
            left = mid + 1
        else:
            right = mid
    return left - 1


# Counts that change every step are not specialised (Triton would compile a variant for a value of
# 1 and for multiples of 16): one variant per tile class, so a warm-up covers them all.
@jit(do_not_specialize=["num_seqs", "num_splits", "window", "chunk"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, seq_order_ptr, sinks_ptr,
        num_seqs, num_splits, scale_log2, v_scale, window, chunk, softcap_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_bt,
        stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TQ: tl.constexpr,
        PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, ORDERED: tl.constexpr,
        V_ASM: tl.constexpr, SLIDING: tl.constexpr, CHUNKED: tl.constexpr, SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    split = tl.program_id(2)
    if ORDERED:                                        # decodes: one tile a sequence
        tile = tl.program_id(1)                        # head-major grid (see the launcher)
        kvh = tl.program_id(0)
        seq = tl.load(seq_order_ptr + tile)
    else:
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = _find_seq(query_start_loc_ptr, num_seqs, tile, TQ)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tq0 = (tile - (q_start // TQ + seq)) * TQ          # first query token of this tile
    if ORDERED:
        tq0 = 0
    if tq0 >= q_len:
        return
    prefix = tl.load(seq_lens_ptr + seq) - q_len       # cached tokens before the queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tq0 + offs_m // GROUP                        # [M] query token within the sequence
    head = kvh * GROUP + offs_m % GROUP                # [M] query head
    row_ok = (offs_m < TQ * GROUP) & (tok < q_len)
    d_ok = offs_d < HEAD_DIM
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)          # [M, D]
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        # NOTE: over an fp8 pool the dots run in fp16, whose conversion from e4m3 is the cheap one
        # (docs/ARCHITECTURE.md, "fp8 KV cache"); exact: bf16's 8 mantissa bits fit in fp16's 11
        # and |q| < 65504, k and v are e4m3 values (|x| <= 448), p is in [0, 1]
        q = q.to(tl.float16)
    q_pos = prefix + tok                               # [M] position of each query
    kv_len = prefix + tl.minimum(tq0 + TQ, q_len)      # keys any row of this tile may see

    num_kb = tl.cdiv(kv_len, BLOCK_N)
    kb_first = 0
    if SLIDING:                                        # blocks before every row's window
        kb_first = tl.maximum(prefix + tq0 - window + 1, 0) // BLOCK_N
    if CHUNKED:                                        # blocks before the first row's chunk
        kb_first = (prefix + tq0) // chunk * chunk // BLOCK_N
    kb_lo = kb_first
    kb_hi = num_kb
    if SPLIT:
        per = tl.cdiv(num_kb - kb_first, num_splits)
        kb_lo = kb_first + split * per
        kb_hi = tl.minimum(kb_lo + per, num_kb)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:     # the sink as a key of logit sinks[head] and value 0, counted once
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink * 1.4426950408889634, m_i)          # log2 domain
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for kb in range(kb_lo, kb_hi):
        pos = kb * BLOCK_N + offs_n                    # [N] key positions
        pos_ok = pos < kv_len
        page = tl.load(table + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = page * stride_cb + (pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)                              # fp8 pool: dequantized (scale folded)
        s = tl.dot(q, tl.trans(k)) * scale_log2        # [M, N], log2 domain
        if SOFTCAP:   # log2e * cap * tanh(x / cap), as cap' tanh(s / cap') with cap' = log2e cap
            s = softcap_log2 * (2.0 * tl.sigmoid(2.0 * s / softcap_log2) - 1.0)
        seen = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        if CHUNKED:
            seen = seen & (pos[None, :] >= q_pos[:, None] // chunk * chunk)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if V_ASM:                                      # fp8 pool, cc 8.9+: see _e4m3_to_f16
            v = _e4m3_to_f16(v)
        else:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None] * v_scale
    store_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = part_out_ptr + split * stride_ps + rows[:, None] * stride_pt
        tl.store(part + head[:, None] * stride_ph + offs_d[None, :], o, mask=store_mask)
        tl.store(part_lse_ptr + split * stride_ls + rows * stride_lt + head, lse, mask=row_ok)
    else:
        dst = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=store_mask)


@jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                         stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                         stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_ok,
                  other=float("-inf"))                 # [S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)                               # [S]; 0 for empty splits
    o = tl.load(part_out_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph
                + offs_d[None, :], mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
                other=0.0)                             # [S, D]
    total = tl.sum(w, 0)
    total = tl.where(total == 0.0, 1.0, total)
    res = tl.sum(o * w[:, None], 0) / total
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@functools.cache
def _has_cvt_e4m3x2(device: torch.device) -> bool:
    """Whether the PTX of _e4m3_to_f16 runs here: compute capability 8.9+, not the interpreter
    (older GPUs convert through Triton's cast)."""
    return (not interpreting() and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (8, 9))


def _tile_config(group: int, max_query_len: int, fp8: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for the longest query in the batch,
    from a sweep on an H200 (docs/BENCHMARKS.md, "Kernels alone")."""
    if max_query_len * group <= 16:              # decodes: one token's heads per tile
        block_n, warps, stages = (128, 4, 2) if fp8 else (64, 4, 2)
        return max(16, next_pow2(group)), block_n, warps, stages
    if max_query_len * group <= 32:
        return 32, 64, 4, 3
    return max(64, next_pow2(group)), 64, 4, 3


def default_num_splits(num_tiles: int, num_kv_heads: int, num_sms: int, max_splits: int = 16
                       ) -> int:
    """Enough splits that the grid covers the GPU about twice; 1 when it already does."""
    programs = num_tiles * num_kv_heads
    if programs >= num_sms:
        return 1
    return max(1, min(max_splits, -(-2 * num_sms // programs)))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int, out: torch.Tensor | None = None,
                    num_splits: int = 1, tile: tuple[int, int, int, int] | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    seq_order: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    chunk: int = 0) -> torch.Tensor:
    """Attend q [T, heads, head_dim] over the pool; returns out [T, heads, head_dim].

    kv_cache is q's dtype or float8_e4m3fn; K and V are read times k_scale and v_scale.

    max_query_len: a host-side upper bound on any sequence's query length (picks the tile
    shape; 1 for a decode-only batch). Rows past query_start_loc[-1] are undefined.
    tile: (BLOCK_M, BLOCK_N, num_warps, num_stages), to override the choice when tuning.
    seq_order: int32 [B], a permutation of the sequences (decode-only batches, max_query_len
    1): the order the grid takes them in.
    window: each query sees only its last `window` positions (itself included); 0: all.
    chunk: each query sees only the positions of its chunk (chunk-aligned) up to itself; 0: all
    (not with a window).
    softcap: scores (after the scale) become softcap * tanh(score / softcap); 0: off.
    sinks: [heads] float logits, one a query head, that join each softmax's denominator (the
    softmax over [scores, sink], the sink's column dropped); None: none.
    """
    require_triton()
    t, heads, d = q.shape
    check(kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[4] == d,
          f"kv_cache {tuple(kv_cache.shape)} is not [blocks, 2, block_size, kv_heads, {d}]")
    kvh = kv_cache.shape[3]
    check(heads % kvh == 0, f"{heads} query heads are not a multiple of {kvh} kv heads")
    check(q.dtype in (torch.float16, torch.bfloat16)
          and kv_cache.dtype in (q.dtype, torch.float8_e4m3fn),
          f"q {q.dtype} must be a 16-bit float type and cache {kv_cache.dtype} the same or "
          f"float8_e4m3fn")
    check(k_scale > 0 and v_scale > 0, f"scales must be positive, got {k_scale}, {v_scale}")
    check(q.stride(2) == 1 and kv_cache.stride(4) == 1, "the head_dim axis must be contiguous")
    b = seq_lens.shape[0]
    check(query_start_loc.shape == (b + 1,) and block_tables.dim() == 2
          and block_tables.shape[0] >= b, f"{b} sequences: query_start_loc "
          f"{tuple(query_start_loc.shape)}, block_tables {tuple(block_tables.shape)}")
    check(seq_lens.dtype == query_start_loc.dtype == block_tables.dtype == torch.int32,
          "seq_lens, query_start_loc and block_tables must be int32")
    check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    check(num_splits >= 1, f"num_splits must be at least 1, got {num_splits}")
    check(window >= 0 and softcap >= 0 and chunk >= 0 and not (window and chunk),
          f"window {window}, chunk {chunk} and softcap {softcap} must be >= 0, and not both "
          f"a window and a chunk")
    check(sinks is None or (sinks.shape == (heads,) and sinks.stride(0) == 1
                            and sinks.dtype in (torch.float16, torch.bfloat16, torch.float32)),
          f"sinks must be a float [{heads}] vector, got "
          f"{None if sinks is None else (tuple(sinks.shape), sinks.dtype)}")
    check(seq_order is None or (max_query_len == 1 and seq_order.shape == (b,)
                                and seq_order.dtype == torch.int32),
          "seq_order is an int32 [B] permutation, for decode-only batches (max_query_len 1)")
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.stride(2) == 1, f"out {tuple(out.shape)} for q "
          f"{tuple(q.shape)}")
    if t == 0 or b == 0:
        return out
    group = heads // kvh
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    block_m, block_n, warps, stages = tile or _tile_config(group, max(1, max_query_len), fp8)
    tq = block_m // group
    if seq_order is not None:
        # NOTE: heads on axis 0, so the KV heads of a sequence are neighbouring programs
        grid = (kvh, b, num_splits)
    else:
        grid = (t // tq + b, kvh, num_splits)
    split = num_splits > 1
    if split:
        part_out = torch.empty((num_splits, t, heads, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, t, heads), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out     # unused
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse,
        block_tables, seq_lens, query_start_loc,
        seq_lens if seq_order is None else seq_order,     # unused without an order
        q if sinks is None else sinks,                     # unused without sinks
        b, num_splits, scale * k_scale * _LOG2E, v_scale, window, chunk, softcap * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=d, HEAD_DIM_PAD=next_pow2(d), BLOCK_M=block_m,
        BLOCK_N=block_n, TQ=tq, PAGE_SIZE=kv_cache.shape[2], SPLIT=split,
        ORDERED=seq_order is not None, V_ASM=fp8 and _has_cvt_e4m3x2(q.device),
        SLIDING=window > 0, CHUNKED=chunk > 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
        num_warps=warps, num_stages=stages, **pdl_args())
    if split:
        _merge_splits_kernel[(t, heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=d, HEAD_DIM_PAD=next_pow2(d), SPLITS_PAD=next_pow2(num_splits),
            num_warps=4, **pdl_args())
    return out
