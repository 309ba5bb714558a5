"""What a request asks of the engine besides how to sample: one struct from the user to the
scheduler, so an option is named once on its way (client, HTTP, offline API, scheduler)."""
from __future__ import annotations

import math

import msgspec

from conveyor.shared.sampling_params import INT64_MAX, INT64_MIN


class RequestOptions(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    priority: int = 0                        # lower runs first (the priority policy)
    ttft_slo: float | None = None            # objective: seconds from arrival to the first token
    tpot_slo: float | None = None            # objective: mean seconds per output token after it
    cache_salt: str | None = None            # prefix-cache blocks are shared only with this salt
    lora: str | None = None                  # the name of a LoRA adapter to run with (HTTP: model)

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not INT64_MIN <= self.priority <= INT64_MAX:
            raise ValueError(f"priority must fit in 64 bits, got {self.priority!r}")
        for name in ("ttft_slo", "tpot_slo"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
