"""Sampling fused into one read of the logits [N, V]: one token per row, the argmax for greedy
rows (T == 0) and for the others (T > 0) the exponential race, with Philox noise drawn in the
kernel: the first column of the highest x * log2(e) / T - log2(E), E ~ Exp(1) in units of ln 2,
is a draw from softmax(x / T). Rows with T < 0 get -1 (the caller samples them); top-k, top-p
and min-p are not handled here.

Noise: Philox4x32-10 (`tl.randint4x`) keyed by the row's 64-bit seed; column c uses output
(c % TILE) // SUB of counter (c // TILE) * SUB + c % SUB (race_noise_ref draws the same).
Grid (N, C): a program writes its chunk's best (score, column) to partials [N, C], and a
second launch reduces each row's. Design and figures: docs/ARCHITECTURE.md, "Decode kernels".
"""
import torch

from conveyor.kernels._triton import (
    grid_sync,
    interpreting,
    jit,
    libdevice,
    pdl_args,
    require_triton,
    tl,
)
from conveyor.kernels._util import check, next_pow2

SUB = 1024                  # columns per load (one Philox output each)
TILE = 4 * SUB              # columns per Philox call of the lanes
_TARGET_PROGRAMS = 4096     # ~30 waves on 132 SMs at N = 256: little tail, tiny partials
_MAX_TILES_PER_CHUNK = 8
_LOG2E = 1.4426950408889634
_INT32_MAX = 2 ** 31 - 1


@jit
def _log2(x, FAST: tl.constexpr):
    # NOTE: tl.log2 is libdevice's log2f, ~20 instructions and a branch per element; the MUFU
    # approximation (abs. error ~2^-22) is one, and the kernel does two per element.
    if FAST:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@jit
def _exp_noise(u, FAST: tl.constexpr):
    """E / ln 2 for E = -ln(1 - w) ~ Exp(1), w = (u + 1/2) / 2^32, u: uint32 draws, to float32
    precision over the whole range. NOTE: -ln of a float32 uniform (tl.rand) resolves small E,
    the likely winners, only to 2^-24: ties, and a bias towards low columns."""
    low = (u >> 31) == 0
    # t = min(w, 1 - w) (times 2^-32 below), from whichever of u, 2^32 - 1 - u is below 2^31
    t = (tl.where(low, u, u ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    series = t * (1.0 + t * (0.5 + t * (0.3333333333333333 + t * (0.25 + t * 0.2))))
    log = -_log2(tl.where(low, 1.0 - t, t), FAST)
    return tl.where(low & (t < 0.0625), series * 1.4426950408889634, log)


@jit
def _keep_best(best, best_col, row_ptr, cols, V, u, scale, RANDOM: tl.constexpr,
               FAST: tl.constexpr):
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    if RANDOM:
        x = x * scale - _log2(_exp_noise(u, FAST), FAST)
    better = x > best                     # strict: a lane keeps its first column of a tie
    return tl.where(better, x, best), tl.where(better, cols, best_col)


@jit
def _best_of_lanes(best, best_col):
    """The best score over the lanes and its first column (torch.argmax's rule for ties)."""
    score = tl.max(best, 0)
    return score, tl.min(tl.where(best == score, best_col, 2147483647), 0)


# The chunk counts follow the batch size: not specialised, so only BLOCK_C (a power of two)
# makes a new variant (paged_attention.py says why).
@jit(do_not_specialize=["tiles_per_chunk", "num_chunks"])
def _sample_chunk_kernel(logits_ptr, temperature_ptr, seed_ptr, part_score_ptr, part_col_ptr,
                         V, stride_row, tiles_per_chunk, num_chunks,
                         SUB: tl.constexpr, GREEDY_ONLY: tl.constexpr, FAST: tl.constexpr,
                         USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = 0.0
    if not GREEDY_ONLY:
        temperature = tl.load(temperature_ptr + row)
        if temperature < 0:               # the caller samples this row
            return
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, SUB)
    first = chunk * tiles_per_chunk
    last = first + tiles_per_chunk
    num_tiles = tl.cdiv(V, 4 * SUB)
    if last > num_tiles:
        last = num_tiles
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_col = first * (4 * SUB) + lanes  # an all -inf lane reports its first column
    if temperature > 0:
        seed = tl.load(seed_ptr + row)
        scale = 1.4426950408889634 / temperature
        for t in range(first, last):
            u0, u1, u2, u3 = tl.randint4x(seed, t * SUB + lanes)
            cols = t * (4 * SUB) + lanes
            best, best_col = _keep_best(best, best_col, row_ptr, cols, V, u0, scale, True, FAST)
            best, best_col = _keep_best(best, best_col, row_ptr, cols + SUB, V, u1, scale, True,
                                        FAST)
            best, best_col = _keep_best(best, best_col, row_ptr, cols + 2 * SUB, V, u2, scale,
                                        True, FAST)
            best, best_col = _keep_best(best, best_col, row_ptr, cols + 3 * SUB, V, u3, scale,
                                        True, FAST)
    else:
        for t in range(first, last):
            cols = t * (4 * SUB) + lanes
            for j in tl.static_range(4):
                best, best_col = _keep_best(best, best_col, row_ptr, cols + j * SUB, V, 0, 1.0,
                                            False, FAST)
    score, col = _best_of_lanes(best, best_col)
    tl.store(part_score_ptr + row * num_chunks + chunk, score)
    tl.store(part_col_ptr + row * num_chunks + chunk, col)


@jit(do_not_specialize=["num_chunks"])
def _sample_reduce_kernel(part_score_ptr, part_col_ptr, temperature_ptr, out_ptr, num_chunks,
                          BLOCK_C: tl.constexpr, GREEDY_ONLY: tl.constexpr,
                          USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    row = tl.program_id(0)
    if not GREEDY_ONLY:
        if tl.load(temperature_ptr + row) < 0:
            tl.store(out_ptr + row, -1)
            return
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    score = tl.load(part_score_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    col = tl.load(part_col_ptr + row * num_chunks + c, mask=mask, other=2147483647)
    best = tl.max(score, 0)
    tl.store(out_ptr + row, tl.min(tl.where(score == best, col, 2147483647), 0).to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor | None = None,
           seeds: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] (rows may be strided; bf16, fp16 or fp32) -> token ids [N] int64.

    temperature [N] float32 per row (0: greedy; < 0: skipped, token -1), None: every row greedy.
    seeds [N] int64: each row's Philox key (any 64 bits), needed with a temperature.
    Nothing waits for the device; the only allocations are the output and [N, C] partials.
    """
    require_triton()
    check(logits.dim() == 2 and logits.stride(1) == 1, f"logits must be [N, V] with unit column "
          f"stride, got {tuple(logits.shape)} strides {logits.stride()}")
    check(logits.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"logits dtype {logits.dtype}")
    n, v = logits.shape
    check(0 < v < _INT32_MAX - TILE, f"vocabulary of {v}")
    greedy_only = temperature is None
    if not greedy_only:
        check(temperature.shape == (n,) and temperature.dtype == torch.float32
              and temperature.is_contiguous(), f"temperature must be [N] float32, got "
              f"{tuple(temperature.shape)} {temperature.dtype}")
        check(seeds is not None and seeds.shape == (n,) and seeds.dtype == torch.int64
              and seeds.is_contiguous(), "seeds must be [N] int64 with a temperature")
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n == 0:
        return out
    tiles = -(-v // TILE)
    tiles_per_chunk = max(1, min(_MAX_TILES_PER_CHUNK, n * tiles // _TARGET_PROGRAMS))
    num_chunks = -(-tiles // tiles_per_chunk)
    part_score = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    part_col = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    # NOTE: unread when greedy_only, but Triton 3.6 still compiles the random branch, whose
    # Philox needs an integer seed: hence `out` (int64) as the stand-in for the seeds
    temperature = logits if greedy_only else temperature
    seeds = out if greedy_only else seeds
    _sample_chunk_kernel[(n, num_chunks)](
        logits, temperature, seeds, part_score, part_col, v, logits.stride(0), tiles_per_chunk,
        num_chunks, SUB=SUB, GREEDY_ONLY=greedy_only, FAST=not interpreting(), num_warps=4,
        **pdl_args())
    _sample_reduce_kernel[(n,)](part_score, part_col, temperature, out, num_chunks,
                                BLOCK_C=next_pow2(num_chunks), GREEDY_ONLY=greedy_only,
                                num_warps=1, **pdl_args())
    return out


# --- torch reference: the same scores from the same Philox draws -----------------------------

_MASK32 = 0xFFFFFFFF


def philox4x32_ref(keys: torch.Tensor, counters: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """Philox4x32 as tl.randint4x computes it: keys [N] int64 (key = low, high 32 bits),
    counters [C] (< 2^32, the first counter word) -> [4, N, C] int64 in [0, 2^32).

    NOTE: int64 products of two 32-bit values wrap past 2^63 in two's complement; their low 64
    bits, which are all that is used, stay exact.
    """
    k0 = (keys & _MASK32)[:, None]
    k1 = ((keys >> 32) & _MASK32)[:, None]
    c0 = counters.to(torch.int64)[None, :].expand(keys.shape[0], -1)
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(rounds):
        p0 = c0 * 0xD2511F53
        p2 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = (((p2 >> 32) & _MASK32) ^ c1 ^ k0, p2 & _MASK32,
                          ((p0 >> 32) & _MASK32) ^ c3 ^ k1, p0 & _MASK32)
        k0 = (k0 + 0x9E3779B9) & _MASK32
        k1 = (k1 + 0xBB67AE85) & _MASK32
    return torch.stack([c0, c1, c2, c3])


def exp_noise_ref(u: torch.Tensor) -> torch.Tensor:
    """The kernel's E / ln 2 (float32) from uint32 draws u (held in int64)."""
    low = u < 2 ** 31
    t = (torch.where(low, u, _MASK32 - u).float() + 0.5) * 2.0 ** -32
    series = t * (1.0 + t * (0.5 + t * (1 / 3 + t * (0.25 + t * 0.2))))
    log = -torch.log2(torch.where(low, 1.0 - t, t))
    return torch.where(low & (t < 0.0625), series * _LOG2E, log)


def race_noise_ref(seeds: torch.Tensor, v: int, first_counter: int = 0) -> torch.Tensor:
    """log2 of the kernel's noise for rows keyed by seeds [N] over columns [0, v): [N, V]
    float32. Counters start at first_counter (sample_nucleus.py's rounds take fresh ranges)."""
    n = seeds.shape[0]
    cols = torch.arange(v, device=seeds.device)
    draws = philox4x32_ref(seeds, first_counter + cols // TILE * SUB + cols % SUB)  # [4, N, V]
    which = (cols % TILE) // SUB                                            # [V]
    u = draws.gather(0, which.expand(1, n, v)).squeeze(0)                   # [N, V]
    return torch.log2(exp_noise_ref(u))


def race_scores_ref(logits: torch.Tensor, temperature: torch.Tensor | None = None,
                    seeds: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's scores [N, V] (float32) for its arguments (every row, skipped ones too)."""
    x = logits.float()
    if temperature is None:
        return x
    scale = torch.tensor(_LOG2E, dtype=torch.float32, device=x.device) / temperature
    random = x * scale[:, None] - race_noise_ref(seeds, x.shape[1])
    return torch.where((temperature > 0)[:, None], random, x)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor | None = None,
               seeds: torch.Tensor | None = None) -> torch.Tensor:
    tokens = race_scores_ref(logits, temperature, seeds).argmax(-1)
    if temperature is not None:
        tokens[temperature < 0] = -1
    return tokens

