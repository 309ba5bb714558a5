"""Triton, or stand-ins that let the kernel files import (and their torch references run) where
Triton is not installed. Launching a kernel there raises."""
from conveyor.kernels import interpreting

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only install
    triton = None
    libdevice = None

    class _NoTriton:
        constexpr = int          # signatures name tl.constexpr at definition time

    tl = _NoTriton()


def jit(fn):
    return triton.jit(fn) if triton is not None else fn


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("this kernel needs Triton (and a CUDA GPU)")


__all__ = ["interpreting", "jit", "libdevice", "require_triton", "tl", "triton"]
