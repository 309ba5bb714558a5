"""Small launcher helpers shared by the kernel files."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_MAX = 448.0                # the largest finite float8 e4m3 value (torch.float8_e4m3fn)


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
