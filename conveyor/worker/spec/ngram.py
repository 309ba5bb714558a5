"""N-gram proposals (prompt lookup): the sequence's own tokens predict its continuation.

The longest suffix of the sequence (prompt_lookup_max tokens down to prompt_lookup_min) that
also occurs earlier in it (prompt and output alike) is looked up; the k tokens that followed
its latest earlier occurrence are the guess. Pays where the output copies its input: editing,
summarising or quoting a given text or code.

Each sequence keeps an index of where every n-gram of those lengths last ended (`NgramIndex`),
brought up to date with the tokens appended since its last lookup (token ids only grow), so a
lookup is a few dict probes: 2-5 µs on the host, where a scan of the whole sequence took
80-110 µs on the GPU machine's host, on the critical path of every step at batch 1.
"""
from __future__ import annotations

from conveyor.worker.sampler import SeqSamplingState


class NgramIndex:
    """Where each n-gram of min_n..max_n tokens of one sequence last ended, among those ending
    before its last token."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(max_n, min_n - 1, -1)          # longest first
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0                                  # n-grams ending before this are in

    def guess(self, tokens: list[int], k: int) -> list[int]:
        """The (up to) k tokens after the latest earlier occurrence of the longest suffix of
        `tokens` (this index's sequence, grown or not since the last call); [] if none."""
        last = len(tokens) - 1
        for end in range(self.indexed, last):
            for n in self.sizes:
                if end + 1 >= n:
                    self.last_end[n][tuple(tokens[end + 1 - n:end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in self.sizes:
            if n <= last:
                end = self.last_end[n].get(tuple(tokens[last + 1 - n:]))
                if end is not None:
                    return tokens[end + 1:end + 1 + k]
        return []


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n
        # slot -> the sequence it holds and that sequence's index (a new sequence in the slot,
        # or the same request recomputed after a preemption, is a new state: a new index)
        self._indexes: dict[int, tuple[SeqSamplingState, NgramIndex]] = {}

    def propose(self, slots: list[int], states: list[SeqSamplingState]) -> list[list[int]]:
        guesses = []
        for slot, state in zip(slots, states):
            held = self._indexes.get(slot)
            if held is None or held[0] is not state:
                held = self._indexes[slot] = (state, NgramIndex(self.min_n, self.max_n))
            guesses.append(held[1].guess(state.token_ids, self.k))
        return guesses
