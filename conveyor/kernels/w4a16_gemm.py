"""W4A16: y = x W^T with W in 4 bits, dequantized in the kernel's registers.

The layout every 4-bit checkpoint (AWQ, GPTQ) is converted to at load (worker/int4_checkpoint.py):
  qweight int32 [N, K / 8]: value k of row n in bits 4 (k % 8) of qweight[n, k // 8] (0..15);
  scale, zero float32 [N, G]: W[n, k] = (q - zero[n, g]) * scale[n, g], g = k // (K / G);
  perm int64 [K] or None: GPTQ act-order, the input columns in group order (x[:, perm] is the
  layer's input in the weight's column order).
`dequantize_int4` is the reference and the CPU path (dequantize, then F.linear). `w4a16_gemm`
takes one of three Triton paths by the number of rows M:
  one row (single-stream decode): a GEMV on the CUDA cores (_w4a16_gemv_kernel), each weight
  row's nibbles turned into floats and multiplied by x, K split among programs as below;
  M < CUBLAS_FROM_M (decode batches): tiles of y^T, the weight rows as the tensor cores' register
  operand: each 128-input step loads 16 consecutive words of each row (coalesced) and unpacks
  them in registers a nibble plane at a time, the weight never going back to memory; K is
  split among programs (the last of a tile sums the parts), so enough bytes are in flight;
  more rows: the weight dequantized to x's dtype in one pass, then cuBLAS (the pass costs about
  as much as reading a bf16 weight once, which a prefill-sized product amortizes). The tiled
  kernel also takes any number of rows, in tiles of 64 each reading the weight again, for
  measuring where CUBLAS_FROM_M belongs (benchmarks/kernel_timings.py, "int4 tiles").
Both take a nibble to a float without a conversion instruction (by OR-ing it into the mantissa
of a power of two, exact). The tiles subtract the zero point in x's dtype, exact for the integer
zero points of 4-bit checkpoints (zero is float32 here, but always a whole number 0..15), and
scale in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.kernels._triton import interpreting, jit, require_triton, split_k_sum, tl
from conveyor.kernels._util import check, num_sms, tile_counts

# rows from which the weight is dequantized to x's dtype and multiplied by cuBLAS: on an H200
# Llama-3.1-8B's layers took 7.35 ms through the tiles at 64 rows (one tile of rows) against
# 9.25 for dequantize + cuBLAS, and 12.3 against 9.5 at 96 (two tiles, each unpacking the weight)
CUBLAS_FROM_M = 65
# NOTE: dequantization tile (rows, words, warps): a row of 512 words (4,096 inputs) a program,
# so it reads and writes long runs: 3.5-3.9 TB/s of words and bf16 on an H200, 16 rows of 64
# words 1.8-2.3 (the best of 21 on Llama-3.1-8B's four layer shapes; docs/QUANTIZATION.md)
DEQUANT_TILE = (1, 512, 4)
# NOTE: GEMV tile (BLOCK_N, BLOCK_W, num_warps): the best of 60 on Llama-3.1-8B's four layer
# shapes on an H200; 32 or 64 words a step took 2-4x as long (its loop is not pipelined: 1 or 3
# stages timed the same)
GEMV_TILE = (128, 16, 4)
# NOTE: weight rows a tile (one tensor-core operand of two warpgroup M's, 4 warps); the sweep's
# best at one to sixteen rows, 64 took 1.1-1.3x longer
BLOCK_N = 128


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


@jit
def _nibble_plane(words, i: tl.constexpr):
    """Nibble i of each word as bfloat16 128 + q (0x4300 | q is that number's bit pattern:
    exact, two integer ops and no conversion)."""
    return (((words >> (4 * i)) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)


@jit
def _pair_plane(words, zb, j: tl.constexpr, ASM: tl.constexpr, BF16: tl.constexpr):
    """words [R, W] int32 -> [R, 2W] in x's dtype: element 2w + h is q - z for nibble
    j + 4h of word w (inputs 8w + j + 4h), zb [R, 2W] int32 holding -(M + z) twice as a pair of
    x's dtype, M the magic number (bf16 128, fp16 1024) whose bit pattern OR-ed with a nibble q
    is the number M + q. With ASM (sm80+, not the interpreter) one shift and one LOP3 make two
    weights' patterns in a 32-bit register and one packed FMA by 1 subtracts M + z from both:
    three instructions for two weights, exact for integer zero points."""
    both = tl.join(words, words).reshape(words.shape[0], 2 * words.shape[1])
    if ASM:
        magic: tl.constexpr = "0x43004300" if BF16 else "0x64006400"
        one: tl.constexpr = "0x3F803F80" if BF16 else "0x3C003C00"
        fma: tl.constexpr = "fma.rn.bf16x2" if BF16 else "fma.rn.f16x2"
        return tl.inline_asm_elementwise(
            f"{{ .reg .b32 t, u, one; mov.b32 one, {one}; shr.u32 t, $1, {4 * j}; "
            f"lop3.b32 u, t, 0x000f000f, {magic}, 0xea; {fma} $0, u, one, $3; }}",
            "=r,r,r,r,r", [both, zb], dtype=tl.bfloat16 if BF16 else tl.float16,
            is_pure=True, pack=2)
    h = tl.join(tl.zeros_like(words), tl.full(words.shape, 16, tl.int32)).reshape(both.shape)
    q = ((both >> (4 * j + h)) & 15).to(tl.float32)
    dt = tl.bfloat16 if BF16 else tl.float16
    zero = (zb & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
    return (q + (128.0 if BF16 else 1024.0) + zero).to(dt)


@jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, GROUP,
                  K_SPLIT, stride_xm, stride_wn, stride_sn, stride_ym, HAS_BIAS: tl.constexpr,
                  GROUP_STEPS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                  BF16: tl.constexpr):
    """y^T tile [BLOCK_N, BLOCK_M] = W_tile x_tile^T, 128 inputs (16 words a weight row) a step.

    Nibble i of word w is input 8 w + i, so the words never change layout (a reshape into k
    order first took 1.1x as long at four parts of K). With GROUP_STEPS (groups of a multiple
    of 128 inputs: one scale and zero a row a step) a step is four dots of [BLOCK_N, 32]
    weights q - z (nibbles j and j + 4 of the 16 words, _pair_plane, the tensor cores'
    register operand) by the inputs 8 w + j + 4 h, and the step's sum is scaled after;
    smaller groups make eight dots of [BLOCK_N, 16] (nibble plane i), each word's column
    scaled before its dot."""
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    tile = tl.program_id(2) * tl.num_programs(0) + tile_n               # for split-K's count
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    # out-of-range rows load a valid row again (wrapped); the store drops them
    wn = (rn % N).to(tl.int64)
    xm = (rm % M).to(tl.int64)
    kw = tl.arange(0, 16)
    w_ptrs = w_ptr + wn[:, None] * stride_wn + kw[None, :]             # [BLOCK_N, 16] words
    x_ptrs = x_ptr + xm[None, :] * stride_xm + 8 * kw[:, None]          # [16, BLOCK_M], plane 0
    s_ptrs = s_ptr + wn * stride_sn
    z_ptrs = z_ptr + wn * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k0 = split * K_SPLIT
    r = tl.arange(0, 32)
    x_pairs = x_ptr + xm[None, :] * stride_xm + (8 * (r // 2) + 4 * (r % 2))[:, None]
    for k in tl.range(k0, tl.minimum(k0 + K_SPLIT, K), 128):
        k_ok = k + 8 * kw < K
        if EVEN_K or GROUP_STEPS:             # K is a multiple of 128 with GROUP_STEPS
            words = tl.load(w_ptrs + k // 8)
        else:
            words = tl.load(w_ptrs + k // 8, mask=k_ok[None, :], other=0)
        if GROUP_STEPS:
            s = tl.load(s_ptrs + k // GROUP)
            z = tl.load(z_ptrs + k // GROUP)
            dt = tl.bfloat16 if BF16 else tl.float16
            zh = (-(z + (128.0 if BF16 else 1024.0))).to(dt).to(tl.int16, bitcast=True)
            zh = zh.to(tl.int32) & 0xFFFF
            zb = tl.broadcast_to((zh | (zh << 16))[:, None], (BLOCK_N, 32))
            part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(4):
                part = tl.dot(_pair_plane(words, zb, j, ASM, BF16), tl.load(x_pairs + k + j),
                              part)
            acc += part * s[:, None]
        else:
            g = (k + 8 * kw) // GROUP                                  # a word's group
            s = tl.load(s_ptrs[:, None] + g[None, :], mask=k_ok[None, :], other=0.0)
            z = tl.load(z_ptrs[:, None] + g[None, :], mask=k_ok[None, :], other=0.0) + 128.0
            for i in tl.static_range(8):
                xi = tl.load(x_ptrs + k + i, mask=(k + 8 * kw + i < K)[:, None], other=0.0)
                w = (_nibble_plane(words, i).to(tl.float32) - z) * s
                acc = tl.dot(w.to(xi.dtype), xi, acc)
    offs = rm[None, :].to(tl.int64) * N + rn[:, None]                  # y^T tile, dense [M, N]
    mask = (rm[None, :] < M) & (rn[:, None] < N)
    last = True
    if SPLIT_K > 1:
        acc, last = split_k_sum(acc, part_ptr, count_ptr, tile, split, offs, mask, M * N, SPLIT_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + wn).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None],
             acc.to(y_ptr.dtype.element_ty), mask=mask & last)


@jit
def _unit_plane(words, i: tl.constexpr):
    """Nibble i of each int32 word as the float32 1 + q / 16, exact: the nibble moved to the
    top of the mantissa (bits 19-22) and OR-ed into 1.0's pattern."""
    if 4 * i <= 19:
        bits = words << (19 - 4 * i)
    else:
        bits = words >> (4 * i - 19)
    return ((bits & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@jit
def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N, K,
                       GROUP, K_SPLIT, stride_wn, stride_sn, HAS_BIAS: tl.constexpr,
                       GROUP_STEPS: tl.constexpr, EVEN_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """y [BLOCK_N] of one row x on the CUDA cores, 8 BLOCK_W inputs (BLOCK_W words a weight
    row) a step.

    With f = 1 + q / 16 (_unit_plane), (q - z) s x = s (16 f x - (16 + z) x): a step sums
    f x over each word's eight inputs (eight FMAs), then folds in the scale and zero once per
    word with the sum of its inputs. f stays within [1, 2), so the subtraction loses at most a
    bit (unlike the 2^23 + q form). GROUP_STEPS: a step lies in one group (one scale and zero
    a row); otherwise each word reads its own group's. EVEN_K: K a multiple of the step, so
    the loads need no mask (and are vectorized).

    Its time is the arithmetic's (about three instructions a weight), not the reads': the
    same reads alone run at 3.7 TB/s on an H200 (docs/QUANTIZATION.md)."""
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = (rn % N).to(tl.int64)
    kw = tl.arange(0, BLOCK_W)
    w_ptrs = w_ptr + wn[:, None] * stride_wn + kw[None, :]             # [BLOCK_N, BLOCK_W]
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    k0 = split * K_SPLIT
    for k in tl.range(k0, tl.minimum(k0 + K_SPLIT, K), 8 * BLOCK_W):
        k_ok = k + 8 * kw < K
        if EVEN_K:
            words = tl.load(w_ptrs + k // 8)
        else:
            words = tl.load(w_ptrs + k // 8, mask=k_ok[None, :], other=0)
        fx = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        xs = tl.zeros([BLOCK_W], dtype=tl.float32)
        for i in tl.static_range(8):
            if EVEN_K:
                xi = tl.load(x_ptr + k + 8 * kw + i).to(tl.float32)
            else:
                xi = tl.load(x_ptr + k + 8 * kw + i, mask=k_ok, other=0.0).to(tl.float32)
            fx += _unit_plane(words, i) * xi[None, :]
            xs += xi
        if GROUP_STEPS:
            s = tl.load(s_ptr + wn * stride_sn + k // GROUP)[:, None]
            z = tl.load(z_ptr + wn * stride_sn + k // GROUP)[:, None]
        else:
            g = (k + 8 * kw) // GROUP
            s = tl.load(s_ptr + wn[:, None] * stride_sn + g[None, :], mask=k_ok[None, :],
                        other=0.0)
            z = tl.load(z_ptr + wn[:, None] * stride_sn + g[None, :], mask=k_ok[None, :],
                        other=0.0)
        acc += (16.0 * s) * fx - (s * (16.0 + z)) * xs[None, :]
    y = tl.sum(acc, axis=1)                                            # [BLOCK_N]
    mask = rn < N
    last = True
    if SPLIT_K > 1:
        y, last = split_k_sum(y, part_ptr, count_ptr, tile_n, split, rn, mask, N, SPLIT_K)
    if HAS_BIAS:
        y += tl.load(b_ptr + wn).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask & last)


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


def _tiling(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, SPLIT_K, K_SPLIT: inputs a part, whole 128-input steps). A decode-sized
    product (up to 32 rows, one tile of them) is a stream of weight bytes: K is split in up to
    eight parts of at least two steps, which put more bytes in flight (on an H200 Llama-3.1-8B's
    four layer shapes took 3.45 ms over 32 layers at 8 parts of 128-row tiles, 4.2 at 4, 5.4 at
    2; docs/QUANTIZATION.md). More rows come in tiles of 64, each reading the weight again, and
    K is split only as far as needed for two programs an SM (132 on an H200), which also bounds
    the float32 parts' buffer."""
    steps = -(-k // 128)
    if m <= 32:
        parts = next((p for p in (8, 4, 2) if steps >= 2 * p), 1)
        block_m = 16 if m <= 16 else 32
    else:
        block_m = 64
        tiles = -(-n // BLOCK_N) * -(-m // block_m)
        allowed = [p for p in (1, 2, 4, 8) if p == 1 or steps >= 2 * p]
        parts = next((p for p in allowed if tiles * p >= 264), allowed[-1])
    k_split = -(-steps // parts) * 128
    return block_m, -(-k // k_split), k_split


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
    if m == 0 or n == 0:
        return y
    if m == 1:                                 # a GEMV: on the CUDA cores
        return _gemv(x, qweight, scale, zero, bias, y)
    block_m, split, k_split = _tiling(m, n, k)
    tiles_n, tiles_m = -(-n // BLOCK_N), -(-m // block_m)
    part = counts = y
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counts = tile_counts(x.device, tiles_n * tiles_m, "w4a16_gemm")
    group = k // g
    _w4a16_kernel[(tiles_n, split, tiles_m)](
        x, qweight, scale, zero, bias if bias is not None else y, y, part, counts, m, n, k,
        group, k_split, x.stride(0), qweight.stride(0), scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, GROUP_STEPS=group % 128 == 0, EVEN_K=k % k_split == 0,
        SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=BLOCK_N, ASM=not interpreting(),
        BF16=x.dtype == torch.bfloat16, num_warps=4, num_stages=3)
    return y


def _gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
          bias: torch.Tensor | None, y: torch.Tensor,
          tile: tuple[int, int, int] | None = None, parts: int | None = None
          ) -> torch.Tensor:
    """y [1, N] = x [1, K] W^T (+ bias) through _w4a16_gemv_kernel. K is split in parts until
    the grid has about four programs an SM (each part at least four steps); tile and parts
    override the choice when tuning."""
    k, n, g = x.shape[1], qweight.shape[0], scale.shape[1]
    block_n, block_w, warps = tile or GEMV_TILE
    step = 8 * block_w
    steps, tiles = -(-k // step), -(-n // block_n)
    if parts is None:
        parts = 1
        while parts < 16 and tiles * parts < 4 * num_sms(x.device) and steps >= 4 * parts:
            parts *= 2
    k_split = -(-steps // parts) * step
    split = -(-k // k_split)
    part = counts = y
    if split > 1:
        part = torch.empty(split, n, dtype=torch.float32, device=x.device)
        counts = tile_counts(x.device, tiles, "w4a16_gemm")
    group = k // g
    _w4a16_gemv_kernel[(tiles, split)](
        x, qweight, scale, zero, bias if bias is not None else y, y, part, counts, n, k, group,
        k_split, qweight.stride(0), scale.stride(0), HAS_BIAS=bias is not None,
        GROUP_STEPS=group % step == 0, EVEN_K=k % step == 0, SPLIT_K=split, BLOCK_N=block_n,
        BLOCK_W=block_w, num_warps=warps)
    return y


def dequantize_int4_gpu(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int4 in one Triton pass: W [N, K] in dtype, new."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    rows, words, warps = DEQUANT_TILE
    if n and k:
        _dequantize_int4_kernel[(-(-n // rows), -(-k // 8 // words))](
            qweight, scale, zero, out, n, k, k // scale.shape[1], qweight.stride(0),
            scale.stride(0), out.stride(0), BLOCK_N=rows, BLOCK_W=words, num_warps=warps)
    return out
