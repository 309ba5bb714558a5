"""Speculative decoding's counters in the scheduler: what was guessed, what was accepted, and
what it cost; Stats carries them to /metrics and the periodic log line (docs/METRICS.md)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecCounts:
    num_drafts: int = 0              # sequence steps that verified at least one guess
    num_draft_tokens: int = 0        # guesses verified
    num_accepted_tokens: int = 0     # guesses accepted
    propose_s: float = 0.0           # worker host time making guesses
    verify_steps: int = 0            # steps that verified guesses
    verify_s: float = 0.0            # their wall time (plan to result)

    def add(self, num_guesses: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_guesses
        self.num_accepted_tokens += num_accepted

    def stats(self) -> dict[str, int | float]:
        """As Stats' spec_* fields."""
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_propose_s": self.propose_s, "spec_verify_steps": self.verify_steps,
                "spec_verify_s": self.verify_s}


def acceptance(num_draft_tokens: int, num_accepted: int, num_drafts: int) -> tuple[float, float]:
    """(acceptance rate, mean accepted length): the share of guesses accepted, and the tokens a
    verifying sequence step yields on average (its accepted guesses plus the one it draws)."""
    return (num_accepted / max(1, num_draft_tokens), 1 + num_accepted / max(1, num_drafts))


def spec_line(now, before) -> str:
    """The stats line's part on speculative decoding between two Stats ("" if none verified)."""
    drafts = now.spec_num_drafts - before.spec_num_drafts
    steps = now.spec_verify_steps - before.spec_verify_steps
    if not drafts or not steps:
        return ""
    rate, length = acceptance(now.spec_num_draft_tokens - before.spec_num_draft_tokens,
                              now.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                              drafts)
    propose = (now.spec_propose_s - before.spec_propose_s) / steps
    verify = (now.spec_verify_s - before.spec_verify_s) / steps
    return (f", speculative: acceptance {100 * rate:.1f} %, mean accepted length {length:.2f}, "
            f"propose {1e3 * propose:.2f} ms/step, verify {1e3 * verify:.2f} ms/step")
