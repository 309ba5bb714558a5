"""Open a GGUF file with the `gguf` package's reader, about four times faster.

GGUFReader parses every metadata field (tens of thousands of tokenizer strings) by slicing a
numpy.memmap, whose per-slice bookkeeping dominates; slicing a plain ndarray view of the same
mapping gives the same arrays without it.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


class FastGGUFReader(gguf.GGUFReader):
    # NOTE: overrides a private method of gguf.GGUFReader (checked against gguf 0.19).
    def _get(self, offset, dtype, count=1, override_order=None):
        if "_plain" not in self.__dict__:
            self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = self._plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def open_gguf(path: Path | str) -> gguf.GGUFReader:
    return FastGGUFReader(path)
