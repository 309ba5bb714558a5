"""N-gram proposals (prompt lookup): the sequence's own tokens predict its continuation.

The longest suffix of the sequence (prompt_lookup_max tokens down to prompt_lookup_min) that
also occurs earlier in it (prompt and output alike) is looked up; the k tokens that followed
its latest earlier occurrence are the guess. Pays where the output copies its input: editing,
summarising or quoting a given text or code. Host-only numpy, about 10-30 µs a sequence.
"""
from __future__ import annotations

import numpy as np

from conveyor.worker.sampler import SeqSamplingState


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, slots: list[int], states: list[SeqSamplingState]) -> list[list[int]]:
        return [ngram_guess(s.token_array(), self.k, self.min_n, self.max_n) for s in states]


def ngram_guess(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The (up to) k tokens after the latest earlier occurrence of the longest suffix of
    `tokens` of min_n..max_n tokens; [] when no such suffix recurs."""
    n = len(tokens)
    if n <= min_n:
        return []
    # positions i < n - 1 holding the last token: where an earlier occurrence could end
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if not ends.size:
        return []
    length = np.ones(ends.size, dtype=np.int64)       # suffix tokens matched, ending at ends
    alive = np.ones(ends.size, dtype=bool)
    for d in range(1, min(max_n, n - 1)):
        before = ends - d
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[n - 1 - d]
        if not alive.any():
            break
        length += alive
    best = int(np.argmax(length * n + ends))          # longest, then latest
    if length[best] < min_n:
        return []
    start = ends[best] + 1
    return tokens[start:start + k].tolist()
