"""Triton kernels for the GPU path: one op per file, each with a typed launcher and a torch
reference (the reference needs no Triton; the launchers import it on first use).

Importing this package never imports Triton, so the CPU install and test suite run without it.
"""
from __future__ import annotations

import functools
import os


@functools.cache
def triton_available() -> bool:
    """True where Triton imports and a CUDA device is present."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def interpreting() -> bool:
    """Kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1); it has no
    libdevice, so kernels that call it take a constexpr flag from this."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
