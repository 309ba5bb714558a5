"""Small tensor helpers of the sampler and of speculative verification: host lists to the device
without a device sync, the top-p and min-p filters, and rows padded into one tensor.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from conveyor.shared.sampling_params import SamplingParams


def to_device(values: list | np.ndarray, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list or array as a tensor on `device`, queued without a device sync.

    NOTE: torch.tensor(values, device="cuda") copies from pageable memory and then waits for the
    stream, so the host would stall until the queued forward pass is done. A copy from pinned
    memory is queued instead (torch's pinned allocator keeps the block until the copy ran).
    """
    if device.type == "cpu":
        return torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(
            values, dtype=dtype)
    if isinstance(values, np.ndarray):
        pinned = torch.from_numpy(values).pin_memory()
    else:
        pinned = torch.tensor(values, dtype=dtype, pin_memory=True)
    return pinned.to(device, non_blocking=True)


def float_column(values: list[float], device: torch.device) -> torch.Tensor:
    """values as a float32 [R, 1] tensor."""
    return to_device(values, device, torch.float32)[:, None]


def uses_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def on_rows(x: torch.Tensor, rows: list[int],
            fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Replaces x[rows] by fn(x[rows]) (in place unless rows is every row, then fn(x))."""
    if len(rows) == x.shape[0]:
        return fn(x)
    idx = to_device(rows, x.device)
    x[idx] = fn(x[idx])
    return x


def keep_top_p(x: torch.Tensor, ps: list[float], is_sorted: bool = False) -> torch.Tensor:
    """x: [R, V]; keeps the smallest set of most likely tokens whose mass reaches ps[r].

    is_sorted: each row of x is already in descending order (no sort, no scatter back).
    """
    p = to_device(ps, x.device)[:, None]  # [R, 1]
    probs = x.softmax(-1)
    if is_sorted:
        sorted_probs, order = probs, None
    else:
        sorted_probs, order = probs.sort(-1, descending=True)  # [R, V]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
    drop = mass_before >= p  # the top token has mass_before 0 < p: always kept
    if order is not None:
        drop = torch.empty_like(drop).scatter_(1, order, drop)
    return x.masked_fill_(drop, float("-inf"))


def keep_min_p(x: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """x: [R, V]; drops tokens less likely than min_ps[r] times the row's most likely one."""
    min_p = to_device(min_ps, x.device)[:, None]  # [R, 1]
    probs = x.softmax(-1)  # [R, V]
    return x.masked_fill_(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))


def pad_rows(rows: list[np.ndarray], pad: int, device: torch.device) -> torch.Tensor:
    """Token arrays as one [R, max_len] int64 tensor, right-padded with `pad`."""
    padded = np.full((len(rows), max(map(len, rows))), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return to_device(padded, device)
