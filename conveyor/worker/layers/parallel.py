"""Tensor-parallel helpers: this rank's place in the group and the two collectives layers use.

The group is the default torch.distributed process group; without one, tp_size is 1 and the
collectives are no-ops, so every layer runs unchanged in a single process.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension, in rank order."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_tensor(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's t on every rank, in place (each rank passes a tensor of the same shape and dtype).
    On the device it is queued like a kernel (NCCL): the host does not wait for it."""
    if tp_size() > 1 and t.numel():
        t = t.contiguous()
        dist.broadcast(t, src=0)
    return t
