"""Small launcher helpers and types shared by the kernel files (no Triton here: the layers
import them on the CPU too)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_MAX = 448.0                # the largest finite float8 e4m3 value (torch.float8_e4m3fn)
# the 16 float4 e2m1 codes (MXFP4's values): sign bit 8, then 2 exponent bits and 1 mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SM count (some launchers size their grids by it); on the CPU (Triton's
    interpreter) an H200's 132, so that it runs the tiles a GPU would."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


# per device: one int32 count per output tile of a split-K kernel, at 0 between calls (the last
# program of a tile resets it; one stream at a time uses them)
_tile_counts: dict[torch.device, torch.Tensor] = {}


def tile_counts(device: torch.device, tiles: int, who: str) -> torch.Tensor:
    """The split-K tile counts of `device`, at least `tiles` of them (grown outside CUDA graph
    capture only: a graph keeps the buffer it captured)."""
    counts = _tile_counts.get(device)
    if counts is None or counts.numel() < tiles:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        check(not capturing, f"{who}: run a split-K shape once before capturing it in a CUDA "
              "graph (its tile counts are allocated then)")
        counts = _tile_counts[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32,
                                                    device=device)
    return counts


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Fp8Rows(NamedTuple):
    """Activations [M, K] quantized per row (x ~= q * scale) by the kernel that produced them,
    for an fp8 GEMM (fp8_gemm.fp8_gemm takes them in place of x; quant_fp8.py)."""
    q: torch.Tensor              # [M, K] float8_e4m3fn
    scale: torch.Tensor          # [M, 1] float32
    dtype: torch.dtype           # the activations' dtype: the GEMM's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape
