"""Fused mixture-of-experts MLP: every (token, chosen expert) pair through its expert's gate/up
projection, SiLU-and-mul, and down projection, weighted by the router and summed per token.

w13 [E, 2I, H] holds each expert's gate rows then up rows, w2 [E, H, I]; x [T, H]; topk_ids
and topk_weights [T, K] come from the router (worker/layers/router.py). The pairs are sorted by
expert and each expert's run padded to whole BLOCK_M tiles (`align`, a counting sort on the
device without a host sync, so it runs inside a CUDA graph; the grid is sized for the worst
case, and tiles past the padded total return at once); then one grouped-GEMM launch computes
gate/up for all experts (each tile reads its expert's weights and gathers its tokens' rows of
x), one SiLU-and-mul, and one launch the down projection, which multiplies each row by its
router weight. The K rows of a token are summed last. `fused_moe_ref` is the torch reference
(and the CPU path): one expert at a time.

gpt-oss's experts have biases, [E, 2I] and [E, H], which the GEMM tiles add to their
expert's rows (before the router weight), and its own activation in place of SiLU-and-mul:
`swiglu` = (alpha, limit), kernels/clamped_swiglu.py.

Quantized experts (--quantization fp8 or int8, or an fp8 checkpoint): w13 and w2 in float8
e4m3 or int8 with float32 scales [E, 2I, G] and [E, H, G]: G = 1, one scale a row, or an fp8
checkpoint's square blocks, one scale a row and group of K / G inputs. The tiles convert the
1-byte weights to x's dtype as they load them (exact: e4m3 and |int8| <= 127 fit bf16 and fp16)
and scale the product's columns, or with groups scale each K step's weight tile before its dot
(the weight dequantized to x's dtype, as a dense block-scaled layer does for many rows); the
activations stay in x's dtype (W8A16 math). 4-bit experts (an AWQ or GPTQ checkpoint): w13 and
w2 int32 words of 8 values along K (kernels/w4a16_gemm.py's layout) with scales and zero points
[E, rows, G]; each K step's words are unpacked into the tile and dequantized, (q - zero) *
scale, before its dot (W4A16). MXFP4 experts (gpt-oss's checkpoints, `fp4`): the same words
holding float4 e2m1 codes, no zero points, and the checkpoint's uint8 e8m0 scales [E, rows,
K / 32], one a row and block of 32 inputs; each nibble becomes its e2m1 value, times its block's
2^(s - 127), both built as float32 bits in the tile.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import E2M1, check


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  w13_zero: torch.Tensor | None = None, w2_zero: torch.Tensor | None = None,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  swiglu: tuple[float, float] | None = None, fp4: bool = False,
                  weight_inputs: bool = False) -> torch.Tensor:
    """The reference: for each expert with tokens, its MLP over them (plus its biases, with
    gpt-oss's clamped SwiGLU where `swiglu` gives its alpha and limit), times their weights,
    added into out [T, H] (in x's dtype, as transformers does); with weight_inputs (Llama 4)
    the weights scale the tokens going in instead. Quantized experts are dequantized (times
    their scales) to x's dtype first."""
    from conveyor.kernels.clamped_swiglu import clamped_swiglu_ref

    if w13_scale is not None:
        w13 = dequantize_experts(w13, w13_scale, w13_zero, x.dtype, fp4)
        w2 = dequantize_experts(w2, w2_scale, w2_zero, x.dtype, fp4)
    out = torch.zeros_like(x)
    flat = topk_ids.reshape(-1).long()
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]                  # [n] (token, k) pair indices
        tokens = pairs // topk_ids.shape[1]
        w = topk_weights.reshape(-1)[pairs, None]
        gate_up = F.linear(x[tokens] * w if weight_inputs else x[tokens], w13[e],
                           None if w13_bias is None else w13_bias[e])
        if swiglu is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = clamped_swiglu_ref(gate_up, *swiglu)
        y = F.linear(act, w2[e], None if w2_bias is None else w2_bias[e])
        if not weight_inputs:
            y = y * w
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       dtype: torch.dtype, fp4: bool = False) -> torch.Tensor:
    """w [E, N, K] 1-byte, or [E, N, K / 8] int32 words of 4-bit values with zero points (with
    fp4: of e2m1 codes, no zero points, the scales uint8 e8m0 bytes); scale (and zero)
    [E, N, G], a row's G groups of K / G inputs -> W [E, N, K] in dtype. An fp4 value times its
    scale is exact in float32 (see _e8m0_half) and rounded to dtype once, as
    mxfp4_checkpoint.dequantize_mxfp4 (transformers) rounds it: the same bits."""
    from conveyor.kernels.w4a16_gemm import unpack_int4

    e, n = w.shape[:2]
    g = scale.shape[2]
    if w.dtype == torch.int32:
        q = unpack_int4(w.reshape(e * n, -1))
        if fp4:             # as the tiles decode them: 2 e2m1(q) times 2^(s - 128)
            q = 2 * torch.tensor(E2M1, device=w.device)[q.long()].view(e, n, g, -1)
            s = scale.to(torch.int32)
            scale = torch.where(s < 2, (s + 1) << 21, (s - 1) << 23).view(torch.float32)
        else:
            q = q.float().view(e, n, g, -1) - zero[..., None]
    else:
        q = w.float().view(e, n, g, -1)
    return (q * scale[..., None]).view(e, n, -1).to(dtype)


@jit
def _count_kernel(ids_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    """counts[e] += the pairs of this block routed to e."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    tl.atomic_add(counts_ptr + ids, 1, mask=ok, sem="relaxed")


@jit
def _offsets_kernel(counts_ptr, cursor_ptr, expert_ids_ptr, total_ptr, num_experts, num_tiles,
                    BLOCK_M: tl.constexpr, E: tl.constexpr, TILES: tl.constexpr):
    """One program: each expert's run padded to BLOCK_M, its start into cursor, the padded total,
    and the expert of every tile (the experts whose runs end at or before the tile's start; tiles
    past the total, which the GEMMs skip, get the last expert)."""
    e = tl.arange(0, E)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + e, end - padded, mask=e < num_experts)
    tl.store(total_ptr, tl.sum(padded, 0))
    end = tl.where(e < num_experts, end, 1 << 30)
    for t0 in range(0, num_tiles, TILES):
        tiles = t0 + tl.arange(0, TILES)
        before = tl.sum((end[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(expert_ids_ptr + tiles, tl.minimum(before, num_experts - 1),
                 mask=tiles < num_tiles)


@jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, n, BLOCK: tl.constexpr):
    """Each pair takes the next free place of its expert's run (in no set order within it)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    place = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
    tl.store(sorted_ids_ptr + place, offs, mask=ok)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T * K (token, k) pairs by expert, each expert's run padded to a multiple of
    block_m. Returns sorted_ids [P] int32 (pair index, or T * K in padding), expert_ids
    [P / block_m] int32 (the expert of each tile) and the padded total [1] int32, where
    P = T * K + E * (block_m - 1) rounded up to block_m is the most it can be.

    A counting sort on the device with static shapes, so no host sync: count the pairs per
    expert, place each run, then scatter the pairs by an atomic cursor per expert. The order of
    pairs within a run is not fixed, and need not be: a row's GEMM result does not depend on the
    rows beside it, and the per-token sum runs in k order. (torch's sort, cumsums and
    searchsorted took 82 us of Qwen3-30B-A3B's 402 us layer at 256 tokens on the H200.)"""
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = flat.numel()
    dev = flat.device
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    block = 1024
    grid = (max(1, -(-n // block)),)
    _count_kernel[grid](flat, counts, n, BLOCK=block)
    _offsets_kernel[(1,)](counts, cursor, expert_ids, total, num_experts, size // block_m,
                          BLOCK_M=block_m, E=max(16, 1 << (num_experts - 1).bit_length()),
                          TILES=64)
    _scatter_kernel[grid](flat, cursor, sorted_ids, n, BLOCK=block)
    return sorted_ids, expert_ids, total


@jit
def _e2m1_x2(x):
    """The float4 e2m1 code in x's low 4 bits (int32; the bits above are ignored) -> twice its
    value in float32 (see _e8m0_half), in 6 integer ops and a product: the code's exponent e
    and mantissa m put in float32's exponent field and top mantissa bit make 2^(e - 127)
    (1 + m / 2), or for e = 0 the subnormal m 2^-127, and 2^127 times that is exactly twice
    e2m1's 2^(e - 1) (1 + m / 2) or m / 2; bit 3 is the sign.

    NOTE: a code-by-code form (two selects on the exponent) took twice the integer work, which
    bounds a decode step's expert GEMMs (each weight decoded for a few rows): this one took
    gpt-oss-20b's MXFP4 decode from 6.09 to 5.55 ms a token and its reference workload from
    3,294 to 3,495 tok/s (H200, 2026-12-05, side by side)."""
    bits = ((x & 7) << 22) | ((x & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 1.7014118346046923e38     # 2^127


@jit
def _e8m0_half(s):
    """MXFP4 scale bytes (int32, 0..255) -> 2^(s - 128) in float32, built as bits: exponent
    field s - 1, or for s = 1 and 0 the subnormals 2^-127 and 2^-128.

    NOTE: half the scale, against _e2m1_x2's doubled values, so that e2m1 * 2^(s - 127) is one
    exact float32 product for every byte: s = 255 too, whose 2^128 is past float32's range; as
    with transformers' ldexp, its 0 stays 0, its 0.5 gives 2^127 and the rest overflow to inf."""
    return tl.where(s < 2, (s + 1) << 21, (s - 1) << 23).to(tl.float32, bitcast=True)


@jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                     total_ptr, scale_ptr, zero_ptr, bias_ptr, num_pairs, N, K, stride_am,
                     stride_we, stride_wn, stride_cm, stride_se, stride_sn, stride_be,
                     TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
                     INT4: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """c[pair] = a[pair // TOP_K] @ w[expert]^T (+ bias[expert] with HAS_BIAS; times the
    pair's router weight), for the pairs of one tile of sorted_ids; a [rows, K], w [E, N, K]
    (1-byte with HAS_SCALE, times scale [E, N, G]: GROUP_K = K / G inputs a scale, 0 for one a
    row; with INT4, [E, N, K / 8] words of 4-bit values and zero points like the scales; with
    FP4 too, the values e2m1 codes, the scales e8m0 bytes and no zero points), bias [E, N],
    c [pairs, N]. A K step lies within one group (BLOCK_K divides GROUP_K)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pairs < num_pairs
    rows = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    WORDS: tl.constexpr = BLOCK_K // 8 if INT4 else BLOCK_K     # weight elements a K step
    offs_w = tl.arange(0, WORDS)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn \
        + offs_w[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if INT4:
            w_ok = offs_w + k0 // 8 < K // 8
        else:
            w_ok = k_ok
        w = tl.load(w_ptrs, mask=w_ok[:, None] & n_ok[None, :], other=0.0)
        if GROUP_K:      # the step's G groups (G = 1: a step within one group)
            G: tl.constexpr = BLOCK_K // GROUP_K if BLOCK_K > GROUP_K else 1
            g = k0 // GROUP_K + tl.arange(0, G)
            s_at = expert * stride_se + offs_n[None, :] * stride_sn + g[:, None]
            s_ok = (g < tl.cdiv(K, GROUP_K))[:, None] & n_ok[None, :]
            s = tl.load(scale_ptr + s_at, mask=s_ok, other=0)
            if INT4:     # nibble i of word j is input 8 j + i
                x = tl.reshape(w[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None],
                               (BLOCK_K, BLOCK_N))
                if FP4:     # e2m1(q) 2^(s - 127), exactly: 2 e2m1(q) times 2^(s - 128)
                    w = _e2m1_x2(x)
                    s = _e8m0_half(s.to(tl.int32))
                else:
                    w = x & 15
            w = tl.reshape(w.to(tl.float32), (G, BLOCK_K // G, BLOCK_N))
            if INT4 and not FP4:
                w = w - tl.load(zero_ptr + s_at, mask=s_ok, other=0.0)[:, None, :]
            w = tl.reshape(w * s.to(tl.float32)[:, None, :], (BLOCK_K, BLOCK_N))
        acc = tl.dot(a, w.to(a.dtype), acc)
        a_ptrs += BLOCK_K
        w_ptrs += WORDS
    if HAS_SCALE and not GROUP_K:
        acc = acc * tl.load(scale_ptr + expert * stride_se + offs_n * stride_sn, mask=n_ok,
                            other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok,
                            other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _tiles(num_pairs: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a mean of num_pairs / num_experts
    rows an expert: an M tile about as tall as an expert's run, so that each expert's weights
    are read once (shorter tiles read them again) and few rows are padding.

    NOTE: from the sweep of scripts/bench_moe_tiles.py (H200, docs/BENCHMARKS.md): Qwen3-30B-A3B
    at 256 tokens (16 rows an expert) 399-402 us against 408 with 64-row tiles; Mixtral at 256
    tokens (64 rows an expert) 816 us against 1,667 with 16-row tiles; 8,192 prefill tokens
    1,735 us against 2,190 with 64 x 128 tiles."""
    rows = num_pairs / num_experts
    if rows <= 8:
        return 16, 64, 128, 4, 3
    if rows <= 32:
        return 32, 64, 128, 4, 3
    return 128, 256, 64, 8, 4


def _step_k(block_k: int, block_m: int, k: int, scale: torch.Tensor | None, int4: bool
            ) -> tuple[int, int]:
    """(BLOCK_K, GROUP_K) for a weight of k inputs: GROUP_K the inputs a scale covers where the
    tile scales its weight before the dot (groups, or any 4-bit weight), else 0. A K step lies
    within one group (BLOCK_K divides GROUP_K) or, in the 16-row tiles, covers whole groups,
    each scaled on its own (GROUP_K divides BLOCK_K: MXFP4's blocks of 32).

    NOTE: gpt-oss-20b's MXFP4 experts (H200, 2026-12-05, bench_latency / bench_throughput):
    steps of one 32-block, 8.14 ms a decoded token (bf16: 3.19) and 4,318 tok/s on the
    reference workload; steps of whole blocks in every tile, 6.13 ms but 3,364 tok/s; in the
    16- and 32-row tiles, 6.09 ms and 3,294 tok/s (the workload's decode runs 32-row tiles).
    Hence whole blocks in the 16-row tiles only (batch 1-2 a step); that mix is unmeasured."""
    group_k = k // scale.shape[2] if scale is not None and (int4 or scale.shape[2] > 1) else 0
    if group_k and (block_k % group_k or block_m > 16):
        block_k = math.gcd(block_k, group_k)
    return block_k, group_k


def _gemm(a, w, scale, zero, bias, c, weights, sorted_ids, expert_ids, total, num_pairs,
          top_k, mul_weight, tiles, fp4=False):
    block_m, block_n, block_k, warps, stages = tiles
    int4 = w.dtype == torch.int32
    n, k = w.shape[1], a.shape[1]
    block_k, group_k = _step_k(block_k, block_m, k, scale, int4)
    grid = (sorted_ids.shape[0] // block_m, -(-n // block_n))
    _moe_gemm_kernel[grid](a, w, c, weights, sorted_ids, expert_ids, total,
                           w if scale is None else scale, w if zero is None else zero,
                           w if bias is None else bias,
                           num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                           0 if scale is None else scale.stride(0),
                           0 if scale is None else scale.stride(1),
                           0 if bias is None else bias.stride(0),
                           TOP_K=top_k, MUL_WEIGHT=mul_weight, HAS_SCALE=scale is not None,
                           INT4=int4, FP4=fp4, HAS_BIAS=bias is not None, GROUP_K=group_k,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                           num_stages=stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tiles: tuple[int, int, int, int, int] | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              w13_zero: torch.Tensor | None = None, w2_zero: torch.Tensor | None = None,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              swiglu: tuple[float, float] | None = None, fp4: bool = False,
              weight_inputs: bool = False) -> torch.Tensor:
    """The MoE MLP of x [T, H] (see the module docstring; fp4: the 4-bit words hold MXFP4's
    e2m1 codes, without zero points, and the scales its e8m0 bytes; weight_inputs: the router
    weights scale the tokens going in, Llama 4's, done as a scale of the gate/up GEMM's rows,
    the same for experts without biases) -> [T, H] in x's dtype."""
    from conveyor.kernels.clamped_swiglu import clamped_swiglu
    from conveyor.kernels.silu_and_mul import silu_and_mul

    require_triton()
    t, h = x.shape
    quantized = w13_scale is not None
    int4 = w13.dtype == torch.int32
    per = 8 if int4 else 1                                  # weight values an element
    e, two_i = w13.shape[:2]
    inter = two_i // 2
    check(w13.shape[2] * per == h and w2.shape == (e, h, inter // per) and two_i % 2 == 0,
          f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} for x {tuple(x.shape)}")
    one_byte = w13.dtype in (torch.float8_e4m3fn, torch.int8)
    check(x.dtype in (torch.float16, torch.bfloat16) and w13.dtype == w2.dtype
          and ((one_byte or int4) if quantized else w13.dtype == x.dtype)
          and (w13_zero is not None) == (int4 and not fp4) and (int4 or not fp4),
          f"x must be fp16 or bf16 and w13, w2 the same, or 1-byte with scales, or 4-bit with "
          f"scales and zero points (fp4: without): {x.dtype}, {w13.dtype}, {w2.dtype}")
    for w, scale, zero, k in ((w13, w13_scale, w13_zero, h), (w2, w2_scale, w2_zero, inter)):
        if not quantized:
            break
        check(scale.dim() == 3 and scale.shape[:2] == w.shape[:2] and k % scale.shape[2] == 0
              and scale.dtype == (torch.uint8 if fp4 else torch.float32)
              and scale.is_contiguous()
              and (zero is None or (zero.shape == scale.shape and zero.dtype == torch.float32
                                    and zero.is_contiguous())),
              "scales (and 4-bit zero points) must be float32 [E, rows, G] (fp4: uint8 e8m0 "
              "bytes), G dividing the inputs")
        group_k = _step_k(16, 16, k, scale, int4)[1]
        check(group_k % 16 == 0, f"groups of inputs must be whole steps of 16 inputs: {k} "
                                 f"inputs, {scale.shape[2]} groups")
    check(x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
          and w13.stride(1) == h // per and w2.stride(1) == inter // per,
          "x rows and the experts' weights must be contiguous")
    for bias, rows in ((w13_bias, two_i), (w2_bias, h)):
        check(bias is None or (bias.shape == (e, rows) and bias.stride(1) == 1
                               and bias.dtype in (torch.float16, torch.bfloat16, torch.float32)),
              f"expert biases must be float [E, rows] with contiguous rows: w13 {tuple(w13.shape)}"
              f", biases {None if bias is None else tuple(bias.shape)}")
    check(not (weight_inputs and w13_bias is not None),
          "weight_inputs with gate/up biases: the rows' scale would scale the biases too")
    top_k = topk_ids.shape[1]
    check(topk_ids.shape == topk_weights.shape == (t, top_k),
          f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}")
    out = torch.empty_like(x)
    if t == 0:
        return out
    pairs = t * top_k
    tiles = tiles or _tiles(pairs, e)
    sorted_ids, expert_ids, total = align(topk_ids, e, tiles[0])
    weights = topk_weights.reshape(-1).contiguous()
    gate_up = torch.empty((pairs, two_i), dtype=x.dtype, device=x.device)
    _gemm(x, w13, w13_scale, w13_zero, w13_bias, gate_up, weights, sorted_ids, expert_ids,
          total, pairs, top_k, weight_inputs, tiles, fp4)
    if swiglu is None:
        act = silu_and_mul(gate_up)                                  # [pairs, I]
    else:
        act = clamped_swiglu(gate_up, *swiglu)
    down = torch.empty((pairs, h), dtype=x.dtype, device=x.device)
    _gemm(act, w2, w2_scale, w2_zero, w2_bias, down, weights, sorted_ids, expert_ids, total,
          pairs, 1, not weight_inputs, tiles, fp4)
    return down.view(t, top_k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
