"""Structured outputs' token mask applied to the logits in place: logits[rows[r], t] = -inf
where bit t % 32 of bitmask[r, t // 32] is clear (bit set: token t allowed). Columns past the
bitmask's 32 * W are masked too.

One program a (row, block of columns): it loads BLOCK // 32 words of its row's mask and writes
-inf only where a token is banned, so a mostly allowed row costs a read of its mask words and
the logits it bans. `apply_token_bitmask_ref` is the torch path (CPU, and the test's reference).
"""
import torch

from conveyor.kernels import interpreting
from conveyor.kernels._triton import jit, require_triton, tl
from conveyor.kernels._util import FLOAT_DTYPES, check

BLOCK = 4096


@jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, V, W, stride_logits, stride_mask,
                    BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(bitmask_ptr + r * stride_mask + cols // 32, mask=cols < 32 * W, other=0)
    banned = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + cols,
             tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=banned & (cols < V))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits: [N, V] float (rows may be strided); bitmask: [R, W] int32; rows: [R] int64 indices
    into logits. In place; nothing waits for the device."""
    check(logits.dim() == 2 and logits.dtype in FLOAT_DTYPES and logits.stride(1) == 1,
          "logits must be [N, V] float with contiguous rows")
    check(bitmask.dim() == 2 and bitmask.dtype == torch.int32 and bitmask.stride(1) == 1,
          "bitmask must be [R, W] int32 with contiguous rows")
    check(rows.shape == (bitmask.shape[0],) and rows.dtype == torch.int64,
          "rows must be [R] int64")
    check(logits.device == bitmask.device == rows.device, "tensors on different devices")
    if not bitmask.shape[0]:
        return
    if not logits.is_cuda and not interpreting():
        apply_token_bitmask_ref(logits, bitmask, rows)
        return
    require_triton()
    V, W = logits.shape[1], bitmask.shape[1]
    grid = (bitmask.shape[0], -(-V // BLOCK))
    _bitmask_kernel[grid](logits, bitmask, rows, V, W, logits.stride(0), bitmask.stride(0),
                          BLOCK=BLOCK, num_warps=4)


def allowed_ref(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] bool: token allowed."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)    # [R, 32 W]
    if allowed.shape[1] < vocab_size:
        pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
        allowed = torch.cat([allowed, pad], 1)
    return allowed[:, :vocab_size]


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: torch.Tensor) -> None:
    """The torch path of apply_token_bitmask."""
    sub = logits[rows]                                                 # [R, V], a copy
    sub.masked_fill_(~allowed_ref(bitmask, logits.shape[1]), float("-inf"))
    logits[rows] = sub
