"""Triton kernels for the GPU path: one op per file, each with a typed launcher and a torch
reference (the reference needs no Triton; the launchers import it on first use).

Importing this package never imports Triton, so the CPU install and test suite run without it.
"""
from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """True where Triton imports and a CUDA device is present."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
