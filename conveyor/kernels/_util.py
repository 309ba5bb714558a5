"""Small launcher helpers shared by the kernel files."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
