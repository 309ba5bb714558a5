"""Worker slots: each running request holds one slot id in [0, max_num_seqs).

The lowest free slot is handed out first. Released slots are also collected for the next plan's
`freed`; workers apply `freed` before `new`, so a slot may be released and reused in one plan.
"""
from __future__ import annotations

import heapq

from conveyor.scheduler.block_manager import IntegrityError


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))          # a heap
        self._released: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)
        self._released.append(slot)

    def take_released(self) -> list[int]:
        """Slots released since the last call, for a plan's `freed`."""
        released, self._released = self._released, []
        return released

    def check_integrity(self, held: list[int | None]) -> None:
        """Raise IntegrityError unless `held` (the slot of every running request) and the free
        slots are all the slots, each once."""
        if None in held or sorted(held + self._free) != list(range(self.num_slots)):
            raise IntegrityError(f"slots are inconsistent: held {held}, free {sorted(self._free)}")
