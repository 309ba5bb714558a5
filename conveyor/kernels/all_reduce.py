"""One-shot all-reduce of x [T, N] bf16/fp16 between the GPUs of one host, optionally followed by
the residual add and RMSNorm of a decoder layer in the same kernel (tensor parallelism's decode
all-reduces, in CUDA graphs). Each rank's symmetric-memory buffer (`bases` [W]: its address as
each rank sees it) holds flags, then receive slots [2 parities, W ranks, rows]. Program r pushes
row r into every peer's slot, raises its flag there to its call count n + 1 (release, system
scope), waits for every peer's (acquire), and sums the W rows in rank order in float32, so every
rank gets the same bits. Protocol and figures: docs/TENSOR_PARALLEL.md.
"""
import torch

from conveyor.kernels._triton import grid_sync, jit, pdl_args, require_triton, tl
from conveyor.kernels._util import check, next_pow2
from conveyor.kernels.rms_norm import rms_normalize

MAX_ROWS = 1024             # programs (rows) per call; flags are [MAX_ROWS, W] int32 a rank
FLAG_BYTES = MAX_ROWS * 8 * 4                     # room for 8 ranks


def buffer_bytes(world: int, max_bytes: int) -> int:
    """The symmetric buffer a rank needs: flags, then [2 parities, W ranks] slots of max_bytes
    (a multiple of 16)."""
    return FLAG_BYTES + 2 * world * max_bytes


# NOTE: rank is not specialized (Triton would compile rank 1 apart), so every rank runs one
# binary: where ranks share a process (the kernel tests), a rank's first launch then loads no
# module while another rank's kernel is already waiting for it
@jit(do_not_specialize=["rank"])
def _one_shot_kernel(x_ptr, out_ptr, res_ptr, res_out_ptr, w_ptr, eps, bases_ptr, counter_ptr,
                     rank, N, slot_elems, stride_x, stride_o, stride_r, stride_ro,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, FLAG_BYTES: tl.constexpr,
                     USE_PDL: tl.constexpr):
    grid_sync(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    n = tl.load(counter_ptr + row)
    # NOTE: slots alternate by parity: this rank writes a peer's slot n % 2 again only in call
    # n + 2, after that peer's flag of call n + 1, raised once its call n (the reader) ended
    parity = n % 2
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    # 1. push this row into slot (parity, rank) of every peer
    mine = FLAG_BYTES // 2 + ((parity * WORLD + rank) * slot_elems + row * N).to(tl.int64)
    for q in tl.static_range(WORLD):
        if q != rank:
            dst = tl.load(bases_ptr + q).to(tl.pointer_type(dtype)) + mine
            tl.store(tl.multiple_of(dst, 16) + cols, x, mask=mask)
    tl.debug_barrier()                  # every thread's stores before the flag that covers them
    # 2. flags: raise ours in every peer, then wait for every peer's in ours
    for q in tl.static_range(WORLD):
        if q != rank:
            flags = tl.load(bases_ptr + q).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags + row * WORLD + rank, n + 1, sem="release", scope="sys")
    own = tl.load(bases_ptr + rank)
    own_flags = own.to(tl.pointer_type(tl.int32))
    # NOTE: program r waits only for program r of each peer; GPUs start programs in index order,
    # so the lowest waiting program's partners are running or next (no deadlock)
    for q in tl.static_range(WORLD):
        if q != rank:
            while tl.atomic_add(own_flags + row * WORLD + q, 0, sem="acquire",
                                scope="sys") != n + 1:
                pass
    tl.debug_barrier()
    # 3. the sum in rank order; the peers' rows from this rank's slots (.cg: from L2, not L1)
    own_data = own.to(tl.pointer_type(dtype)) + FLAG_BYTES // 2
    acc = tl.zeros([BLOCK], tl.float32)
    for q in tl.static_range(WORLD):
        slot = own_data + ((parity * WORLD + q) * slot_elems + row * N).to(tl.int64)
        v = tl.load(tl.multiple_of(slot, 16) + cols, mask=mask & (q != rank), other=0.0,
                    cache_modifier=".cg")
        acc += tl.where(q == rank, x.to(tl.float32), v.to(tl.float32))
    tl.store(counter_ptr + row, n + 1)
    y = acc.to(dtype)
    if NORM:
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row.to(tl.int64) * stride_r + cols, mask=mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + row.to(tl.int64) * stride_ro + cols, y, mask=mask)
        y = rms_normalize(y, tl.load(w_ptr + cols, mask=mask, other=0.0), eps, N)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, y.to(out_ptr.dtype.element_ty),
             mask=mask)


def one_shot_all_reduce(x: torch.Tensor, bases: torch.Tensor, counters: torch.Tensor,
                        rank: int, max_bytes: int, weight: torch.Tensor | None = None,
                        eps: float = 1e-6, residual: torch.Tensor | None = None):
    """The sum of x [T, N] (bf16 or fp16, rows may be strided) over the W ranks whose symmetric
    buffers `bases` [W] int64 addresses (buffer_bytes(W, max_bytes) each); counters: this rank's
    [MAX_ROWS] int32, zeroed once, passed to every call.

    Without weight: returns the sum, a new [T, N] tensor. With weight [N]: RMSNorm of the sum
    (of sum + residual with a residual), like kernels/rms_norm.rms_norm, which also returns
    sum + residual then. Every rank calls this with the same shapes in the same order.
    """
    require_triton()
    check(x.dim() == 2 and x.stride(1) == 1, f"x must be [T, N] with unit column stride, got "
          f"{tuple(x.shape)} strides {x.stride()}")
    check(x.dtype in (torch.bfloat16, torch.float16), f"x dtype {x.dtype}")
    t, n = x.shape
    world = bases.shape[0]
    check(2 <= world <= 8 and bases.dtype == torch.int64, "bases must be [W] int64, 2 <= W <= 8")
    check(0 <= rank < world, f"rank {rank} of {world}")
    check(t <= MAX_ROWS and t * n * x.element_size() <= max_bytes,
          f"[{t}, {n}] is over the one-shot limit ({MAX_ROWS} rows, {max_bytes} bytes)")
    check(n % 8 == 0, f"rows of {n}: the one-shot path moves 16-byte vectors")
    check(counters.shape == (MAX_ROWS,) and counters.dtype == torch.int32, "counters")
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        check(weight is not None, "a residual needs the norm's weight")
        check(residual.shape == x.shape and residual.dtype == x.dtype
              and residual.stride(1) == 1, f"residual {tuple(residual.shape)}")
        res_out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if weight is not None:
        check(weight.shape == (n,) and weight.is_contiguous(), f"weight {tuple(weight.shape)}")
    if t:
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        block = next_pow2(n)
        _one_shot_kernel[(t,)](x, out, r, ro, weight if weight is not None else x, eps, bases,
                               counters, rank, n, max_bytes // x.element_size(), x.stride(0),
                               out.stride(0), r.stride(0), ro.stride(0), WORLD=world,
                               BLOCK=block, NORM=weight is not None,
                               HAS_RESIDUAL=residual is not None, FLAG_BYTES=FLAG_BYTES,
                               num_warps=min(8, max(1, block // 256)), **pdl_args())
    if residual is not None:
        return out, res_out
    return out


def one_shot_all_reduce_ref(parts: list[torch.Tensor], weight: torch.Tensor | None = None,
                            eps: float = 1e-6, residual: torch.Tensor | None = None):
    """The kernel's result from every rank's x: the float32 sum in rank order, rounded, then
    (with weight) the fused residual add and RMSNorm of kernels/rms_norm.rms_norm_ref."""
    from conveyor.kernels.rms_norm import rms_norm_ref

    total = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        total += p.float()
    total = total.to(parts[0].dtype)
    if weight is None:
        return total
    return rms_norm_ref(total, weight, eps, residual)
