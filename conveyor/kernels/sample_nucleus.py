"""Top-p and min-p sampling without a sort: for each of the given rows of the logits, a draw from
softmax(x / T) restricted to the row's nucleus: token i is kept if the tokens strictly more
likely than it hold less than top_p of the mass and p_i >= min_p * max_j p_j (a tie at the
top-p boundary is kept whole). By rejection, one program a row: a read of the row for its max and
normaliser and a first candidate, then rounds that each check the last candidate while racing
the next among the tokens more likely than it. Round n's noise is sample.py's Philox keyed by the
row's seed at counters n * tiles * SUB + (the column's counter there); scores are in log2 units.
Design and figures: docs/ARCHITECTURE.md, "Top-p and min-p without a sort".
"""
import torch

from conveyor.kernels._triton import grid_sync, interpreting, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import check
from conveyor.kernels.sample import (
    _INT32_MAX,
    _LOG2E,
    SUB,
    TILE,
    _best_of_lanes,
    _exp_noise,
    _log2,
    race_noise_ref,
)

# A round ends with a token more likely than the last candidate, so rounds are bounded by the
# number of distinct logits; in practice a few (log2 V when the nucleus is one token of a flat
# row). The cap only guards against NaN logits, which would otherwise never be accepted.
MAX_ROUNDS = 64


@jit
def _first_read(m, total, best, best_col, row_ptr, cols, V, u, scale, FAST: tl.constexpr):
    """One load of the first read: running max and normaliser per lane, and the first race."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * scale
    m_new = tl.maximum(m, x)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    total = total * tl.exp2(m - m_safe) + tl.exp2(x - m_safe)
    score = x - _log2(_exp_noise(u, FAST), FAST)
    better = score > best                 # strict: a lane keeps its first column of a tie
    return m_new, total, tl.where(better, score, best), tl.where(better, cols, best_col)


@jit
def _round_read(mass, best, best_col, row_ptr, cols, V, u, scale, x_cand, row_max, low,
                FAST: tl.constexpr):
    """One load of a round: the mass above the candidate, and the race among the tokens above
    it and at or above `low`."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * scale
    above = x > x_cand
    mass += tl.where(above, tl.exp2(x - row_max), 0.0)
    score = tl.where(above & (x >= low), x - _log2(_exp_noise(u, FAST), FAST), float("-inf"))
    better = score > best
    return mass, tl.where(better, score, best), tl.where(better, cols, best_col)


@jit
def _nucleus_kernel(logits_ptr, rows_ptr, temperature_ptr, top_p_ptr, min_p_ptr, seed_ptr,
                    out_ptr, V, stride_row, SUB: tl.constexpr, MAX_ROUNDS: tl.constexpr,
                    FAST: tl.constexpr, USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    r = tl.program_id(0)
    row_ptr = logits_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride_row
    scale = 1.4426950408889634 / tl.load(temperature_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    min_p = tl.load(min_p_ptr + r)
    seed = tl.load(seed_ptr + r)
    lanes = tl.arange(0, SUB)
    num_tiles = tl.cdiv(V, 4 * SUB)

    m = tl.full([SUB], float("-inf"), tl.float32)
    total = tl.zeros([SUB], tl.float32)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_col = lanes
    for t in range(num_tiles):
        u0, u1, u2, u3 = tl.randint4x(seed, t * SUB + lanes)
        cols = t * (4 * SUB) + lanes
        m, total, best, best_col = _first_read(m, total, best, best_col, row_ptr, cols, V, u0,
                                               scale, FAST)
        m, total, best, best_col = _first_read(m, total, best, best_col, row_ptr, cols + SUB, V,
                                               u1, scale, FAST)
        m, total, best, best_col = _first_read(m, total, best, best_col, row_ptr,
                                               cols + 2 * SUB, V, u2, scale, FAST)
        m, total, best, best_col = _first_read(m, total, best, best_col, row_ptr,
                                               cols + 3 * SUB, V, u3, scale, FAST)
    row_max = tl.max(m, 0)
    row_sum = tl.sum(total * tl.exp2(m - row_max), 0)     # the normaliser, relative to row_max
    # p_i >= min_p * p_max, in log2 units (min_p 0: no bound)
    low = tl.where(min_p > 0, row_max + tl.log2(tl.maximum(min_p, 1e-30)), float("-inf"))
    _, cand = _best_of_lanes(best, best_col)
    rnd = r * 0 + 1                                        # int32 scalars, carried by the loop
    done = r * 0
    while (done == 0) & (rnd <= MAX_ROUNDS):
        x_cand = tl.load(row_ptr + cand).to(tl.float32) * scale
        mass = tl.zeros([SUB], tl.float32)
        best = tl.full([SUB], float("-inf"), tl.float32)
        best_col = lanes
        for t in range(num_tiles):
            u0, u1, u2, u3 = tl.randint4x(seed, (rnd * num_tiles + t) * SUB + lanes)
            cols = t * (4 * SUB) + lanes
            mass, best, best_col = _round_read(mass, best, best_col, row_ptr, cols, V, u0, scale,
                                               x_cand, row_max, low, FAST)
            mass, best, best_col = _round_read(mass, best, best_col, row_ptr, cols + SUB, V, u1,
                                               scale, x_cand, row_max, low, FAST)
            mass, best, best_col = _round_read(mass, best, best_col, row_ptr, cols + 2 * SUB, V,
                                               u2, scale, x_cand, row_max, low, FAST)
            mass, best, best_col = _round_read(mass, best, best_col, row_ptr, cols + 3 * SUB, V,
                                               u3, scale, x_cand, row_max, low, FAST)
        # NOTE: with top_p 1 the mass test is skipped: the mass above a very unlikely token,
        # summed in another order than row_sum, may round up to it
        in_top_p = (top_p >= 1.0) | (tl.sum(mass, 0) < top_p * row_sum)
        accept = in_top_p & (x_cand >= low)
        done = accept.to(tl.int32)
        _, nxt = _best_of_lanes(best, best_col)
        cand = tl.where(accept, cand, nxt)
        rnd += 1
    tl.store(out_ptr + r, cand.to(tl.int64))


def sample_nucleus(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor
                   ) -> torch.Tensor:
    """One token for each of rows [R] (int64 indices into logits [N, V]; bf16, fp16 or fp32,
    rows may be strided) from softmax(x / T) restricted by top_p and min_p; returns [R] int64.

    temperature (> 0), top_p (in (0, 1]) and min_p (in [0, 1]): [R] float32; seeds: [R] int64,
    each row's Philox key. Nothing waits for the device; the only allocation is the output.
    """
    require_triton()
    check(logits.dim() == 2 and logits.stride(1) == 1, f"logits must be [N, V] with unit column "
          f"stride, got {tuple(logits.shape)} strides {logits.stride()}")
    check(logits.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"logits dtype {logits.dtype}")
    v = logits.shape[1]
    check(0 < v < _INT32_MAX - TILE, f"vocabulary of {v}")
    r = rows.shape[0]
    check(rows.dim() == 1 and rows.dtype == torch.int64, "rows must be [R] int64")
    for name, t in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        check(t.shape == (r,) and t.dtype == torch.float32 and t.is_contiguous(),
              f"{name} must be [R] float32, got {tuple(t.shape)} {t.dtype}")
    check(seeds.shape == (r,) and seeds.dtype == torch.int64 and seeds.is_contiguous(),
          "seeds must be [R] int64")
    out = torch.empty(r, dtype=torch.long, device=logits.device)
    if r == 0:
        return out
    _nucleus_kernel[(r,)](logits, rows, temperature, top_p, min_p, seeds, out, v,
                          logits.stride(0), SUB=SUB, MAX_ROUNDS=MAX_ROUNDS,
                          FAST=not interpreting(), num_warps=8,
                          **pdl_args())
    return out


# --- torch reference: the same rounds from the same Philox draws -----------------------------

def sample_nucleus_ref(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor
                       ) -> torch.Tensor:
    """The kernel's draws, row by row in torch (its rounds, its Philox noise, its rules)."""
    out = []
    for i in range(rows.shape[0]):
        scale = torch.tensor(_LOG2E, dtype=torch.float32, device=logits.device) / temperature[i]
        x = logits[rows[i]].float() * scale                                 # [V], log2 units
        v, tiles = x.shape[0], -(-x.shape[0] // TILE)
        row_max = x.max()
        row_sum = torch.exp2(x - row_max).sum()
        low = row_max + torch.log2(min_p[i]) if min_p[i] > 0 else torch.tensor(float("-inf"))
        cand = (x - race_noise_ref(seeds[i:i + 1], v)[0]).argmax()
        rnd = 1
        while rnd <= MAX_ROUNDS:
            above = x > x[cand]
            mass = torch.exp2(x - row_max)[above].sum()
            if (top_p[i] >= 1 or mass < top_p[i] * row_sum) and x[cand] >= low:
                break
            noise = race_noise_ref(seeds[i:i + 1], v, rnd * tiles * SUB)[0]
            score = torch.where(above & (x >= low), x - noise, float("-inf"))
            cand = score.argmax()
            rnd += 1
        out.append(cand)
    return torch.stack(out) if out else torch.empty(0, dtype=torch.long, device=logits.device)


def nucleus_ref(x: torch.Tensor, temperature: float, top_p: float, min_p: float) -> torch.Tensor:
    """The set sample_nucleus keeps for one row x [V], as a bool mask (exact, in float64)."""
    probs = (x.double() / temperature).softmax(-1)
    above = (probs[None, :] > probs[:, None]).double() @ probs          # [V]: mass more likely
    keep = above < top_p if top_p < 1 else torch.ones_like(probs, dtype=torch.bool)
    return keep & (probs >= min_p * probs.max())
