"""Tensor-parallel helpers: this rank's place in the group and the collectives layers use.

The group is the default torch.distributed process group, or with pipeline parallelism this
stage's group (`set_tp_group`); without one, tp_size is 1 and the collectives are no-ops, so
every layer runs unchanged in a single process.

On CUDA, the all-reduces of decode steps captured in CUDA graphs (up to 8 MB / W, bf16 or fp16)
go through the one-shot kernel of kernels/all_reduce.py over PyTorch's symmetric memory once
`enable_custom_all_reduce` has set it up, and `all_reduce_rms_norm` folds the decoder layer's
residual add and RMSNorm into it. Everything else (eager steps, larger messages, other dtypes,
gloo on CPU) uses torch.distributed.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_tp_group = None     # None: the default group (no pipeline parallelism)
_single = False      # inside single_rank()


def set_tp_group(group) -> None:
    """Make `group` (a pipeline stage's ranks) the tensor-parallel group of every layer."""
    global _tp_group
    _tp_group = group


@contextmanager
def single_rank() -> Iterator[None]:
    """For a model held whole by one rank (a draft replicated rather than sharded): layers
    built and run inside see one rank, rank 0 of 1, and their collectives do nothing."""
    global _single
    before, _single = _single, True
    try:
        yield
    finally:
        _single = before


def tp_rank() -> int:
    return (dist.get_rank(_tp_group) if not _single and dist.is_available()
            and dist.is_initialized() else 0)


def tp_size() -> int:
    return (dist.get_world_size(_tp_group) if not _single and dist.is_available()
            and dist.is_initialized() else 1)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


class _OneShot:
    """This rank's symmetric buffer (flags and receive slots), every rank's address of it, and
    the kernel's call counters."""

    def __init__(self, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        from conveyor.kernels.all_reduce import FLAG_BYTES, MAX_ROWS, buffer_bytes

        world = tp_size()
        if world > 8:
            raise RuntimeError(f"the one-shot kernel takes up to 8 ranks, not {world}")
        self.max_bytes = (8 << 20) // world
        buffer = symm_mem.empty(buffer_bytes(world, self.max_bytes), dtype=torch.uint8,
                                device=device)
        buffer[:FLAG_BYTES].zero_()
        group = dist.group.WORLD if _tp_group is None else _tp_group
        handle = symm_mem.rendezvous(buffer, group.group_name)
        offset = buffer.data_ptr() - handle.buffer_ptrs[tp_rank()]
        self.buffer = buffer
        self.bases = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64,
                                  device=device)
        self.counters = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=_tp_group)        # every rank's flags are zero before any call

    def takes(self, x: torch.Tensor) -> bool:
        """Decode-sized x, in a CUDA graph being captured. NOTE: eager calls (prefill and mixed
        steps, enforce_eager) stay with NCCL: launched from Python one call of the kernel took
        60-95 us against NCCL's 26-44; replayed from a graph it takes 3.6 against 17-21
        (two H200s, scripts/bench_allreduce.py)."""
        return torch.cuda.is_current_stream_capturing() and self.fits(x)

    def fits(self, x: torch.Tensor) -> bool:
        from conveyor.kernels.all_reduce import MAX_ROWS

        return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
                and x.stride(1) == 1 and x.shape[1] % 8 == 0 and x.shape[0] <= MAX_ROWS
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor, weight=None, eps: float = 1e-6, residual=None):
        from conveyor.kernels.all_reduce import one_shot_all_reduce

        return one_shot_all_reduce(x, self.bases, self.counters, tp_rank(), self.max_bytes,
                                   weight, eps, residual)


_one_shot: _OneShot | None = None           # set by enable_custom_all_reduce (TP > 1 only)


def enable_custom_all_reduce(device: torch.device) -> bool:
    """Set up the one-shot all-reduce on this CUDA device (collective: every rank calls it, and
    every rank gets the same answer). False, with NCCL kept, where it cannot be set up."""
    global _one_shot
    ok = True
    try:
        one_shot = _OneShot(device)
    except (ImportError, AttributeError, RuntimeError) as e:
        print(f"conveyor: rank {tp_rank()}: custom all-reduce unavailable ({e}); using NCCL",
              flush=True)
        ok = False
    if min_over_ranks(int(ok), device) == 1:
        _one_shot = one_shot
        return True
    return False


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks: a new tensor (one-shot) or x itself, summed in place."""
    if tp_size() == 1:
        return x
    if _one_shot is not None and _one_shot.takes(x):
        return _one_shot(x)
    dist.all_reduce(x, group=_tp_group)
    return x


def all_reduce_rms_norm(x: torch.Tensor, norm, residual: torch.Tensor | None = None,
                        fp8: bool = False):
    """norm(sum of x over the ranks, residual, fp8): one kernel where the one-shot path takes
    x (its rows come back unquantized: the next layer quantizes them)."""
    if (_one_shot is not None and not _single and _one_shot.takes(x)
            and norm.weight.dtype == x.dtype):
        return _one_shot(x, norm.weight, norm.eps, residual)
    return norm(all_reduce(x), residual, fp8=fp8)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension, in rank order."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The minimum of value over every rank of the replica (all pipeline stages)."""
    if _world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel group's rank 0's t on every rank of the group, in place (each rank
    passes a tensor of the same shape and dtype). On the device it is queued like a kernel
    (NCCL): the host does not wait for it."""
    if tp_size() > 1 and t.numel():
        t = t.contiguous()
        src = 0 if _tp_group is None else dist.get_global_rank(_tp_group, 0)
        dist.broadcast(t, src=src, group=_tp_group)
    return t
