"""What every reasoning parser shares: `feed` and `finish` return (reasoning, content) pieces of
the output as it streams; `parse` runs the same machine over a whole output, so a stream and a
whole reply agree. `constraint_start` says where a structured-output constraint starts
(`thought_open`: unless the output begins otherwise).
"""
from __future__ import annotations


class ReasoningParser:
    keeps_special_tokens = False              # the format's markers are special tokens
    writes_calls = False                      # tool calls are messages of the format (harmony)

    def __init__(self, calls: bool = True) -> None:
        self.buf = ""
        self.calls = calls                    # writes_calls: a call is a call (else content)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)

    @classmethod
    def parse(cls, text: str, calls: bool = True) -> tuple[str, str]:
        """The whole output's (reasoning, content)."""
        parser = cls(calls)
        r1, c1 = parser.feed(text)
        r2, c2 = parser.finish()
        return r1 + r2, c1 + c2

    @staticmethod
    def constraint_start(tokenizer, prompt_ids: list[int], so) -> list[int] | None:
        """The token ids after which the structured-output constraint `so` starts (None: from
        the first generated token)."""
        raise NotImplementedError

    @classmethod
    def thought_open(cls, tokenizer) -> list[int] | None:
        """The token ids that open a thought the output may leave out (then the constraint
        holds from the first token); None: the output always thinks first."""
        return None
