"""Structured outputs' counters in the scheduler: how many steps and rows took a token bitmask,
what filling it cost worker rank 0, and how long the step loop waited for it; Stats carries them
to /metrics and the periodic log line (docs/METRICS.md)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MaskCounts:
    steps: int = 0                   # steps with constrained rows
    rows: int = 0                    # their constrained rows
    fill_s: float = 0.0              # bitmask fills (advance the matchers, fill), on any thread
    wait_s: float = 0.0              # the step loop's waits for them

    def add(self, rows: int, fill_s: float, wait_s: float) -> None:
        if rows:
            self.steps += 1
            self.rows += rows
            self.fill_s += fill_s
            self.wait_s += wait_s

    def stats(self) -> dict[str, int | float]:
        """As Stats' structured_* fields."""
        return {"structured_steps": self.steps, "structured_rows": self.rows,
                "structured_fill_s": self.fill_s, "structured_wait_s": self.wait_s}


def mask_line(now, before) -> str:
    """The stats line's part on structured outputs between two Stats ("" if no step had a
    constrained row)."""
    steps = now.structured_steps - before.structured_steps
    if not steps:
        return ""
    rows = (now.structured_rows - before.structured_rows) / steps
    fill = (now.structured_fill_s - before.structured_fill_s) / steps
    wait = (now.structured_wait_s - before.structured_wait_s) / steps
    return (f", structured outputs: {rows:.1f} rows/step, bitmask {1e3 * fill:.2f} ms/step, "
            f"waited for {1e3 * wait:.2f} ms/step")
