"""Incremental detokenization and stop strings for one generated sequence.

Text is decoded a few tokens at a time with some tokens of left context (so tokenizers that mark
word starts decode spaces right); a piece ending in an incomplete UTF-8 character is held back
until the next token completes it. Stop strings are searched only where new text could form one.
"""
from __future__ import annotations

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.stopped_by: str | None = None     # the stop string that ended the text, if any
        self._streamed = 0                     # characters of `text` already handed out

    def push(self, new_ids: list[int]) -> None:
        """Add generated tokens; sets `stopped_by` when a stop string appears."""
        if self.stopped_by is not None or self.tokenizer is None:   # no tokenizer: ids only
            return
        for token in new_ids:
            self.ids.append(token)
            piece = self._decode_piece()
            if piece and self._append(piece):
                return

    def flush(self) -> None:
        """At the end: whatever bytes are still pending are decoded, replacement marks and all."""
        if self.stopped_by is None and self.tokenizer and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self._append(self._decode(self.ids[self.prefix_offset:])[len(prefix):])
            self.read_offset = len(self.ids)

    def stream(self, final: bool = False) -> str:
        """Text not yet handed out, minus a tail that could still grow into a stop string."""
        end = len(self.text) if final or self.stopped_by is not None else self._safe_end()
        delta = self.text[self._streamed:end]
        self._streamed = max(self._streamed, end)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_piece(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def _append(self, piece: str) -> bool:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += piece
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_by = s
        return True

    def _safe_end(self) -> int:
        for n in range(min(len(self.text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return len(self.text) - n
        return len(self.text)
