"""Triton, or stand-ins that let the kernel files import (and their torch references run) where
Triton is not installed; launching a kernel there raises. Also programmatic dependent launch
(PDL, Hopper and later; CONVEYOR_PDL=0 turns it off): a kernel launched with pdl_args() calls
grid_sync(USE_PDL) before it touches global memory, which waits for the previous kernel's
writes and lets the next kernel launch (or grid_wait first and launch_next later).
Design and figures: docs/ARCHITECTURE.md, "Programmatic dependent launch".
"""
import functools
import os

from conveyor.kernels import interpreting

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only install
    triton = None
    libdevice = None

    class _NoTriton:
        constexpr = int          # signatures name tl.constexpr at definition time

    tl = _NoTriton()


def jit(fn=None, **options):
    """triton.jit, as `@jit` or `@jit(do_not_specialize=[...])`; the function itself without
    Triton."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if triton is not None else fn


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("this kernel needs Triton (and a CUDA GPU)")


@functools.cache
def pdl() -> bool:
    """Whether kernels launch with PDL: on a CUDA device of compute capability 9 or more, not
    under the interpreter, unless CONVEYOR_PDL=0."""
    if triton is None or interpreting() or os.environ.get("CONVEYOR_PDL", "1") == "0":
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def pdl_args() -> dict:
    """The launch keywords of a kernel that calls grid_sync(USE_PDL) first."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl() else {"USE_PDL": False}


@jit
def grid_sync(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (see above)."""
    grid_wait(USE_PDL)
    launch_next(USE_PDL)


@jit
def grid_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes (grid_sync without letting the next one launch)."""
    if USE_PDL:
        gdc_wait()


@jit
def launch_next(USE_PDL: tl.constexpr):
    """Let the next kernel launch (its programs then wait in their grid_wait for this one)."""
    if USE_PDL:
        gdc_launch_dependents()


@jit
def weight_major_tile(tile, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (batch rows, weight rows) of a GEMM's tile number `tile` over y [M, N], numbered so
    that a weight tile's batch tiles are neighbours: they run together, and W leaves DRAM once."""
    num_m = tl.cdiv(M, BLOCK_M)
    rm = (tile % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn


__all__ = ["grid_sync", "grid_wait", "interpreting", "jit", "launch_next", "libdevice", "pdl",
           "pdl_args", "require_triton", "tl", "triton", "weight_major_tile"]


@jit
def split_k_sum(acc, part_ptr, count_ptr, tile, split, offs, mask, size,
                SPLIT_K: tl.constexpr):
    """Split-K's sum within the one launch: every program stores its float32 part of the tile
    (at part_ptr + split * size + offs) and counts itself in; the last of the tile's SPLIT_K
    adds the parts in split order (the same sum every run), resets the tile's count (0 between
    calls) and gets (the sum, True); the others get (acc, False) and store nothing."""
    tl.store(part_ptr + split * size + offs, acc, mask=mask)
    tl.debug_barrier()              # every thread's part is stored before the count
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    if last:
        acc = tl.zeros_like(acc)
        for p in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + p * size + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)
    return acc, last
