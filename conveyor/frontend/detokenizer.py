"""Incremental detokenization and stop strings for one generated sequence.

Text comes from the tokenizer's own streaming decoder (`tokenizers`' DecodeStream, in Rust: about
a microsecond a token), primed with the end of the prompt so that the first token's leading space
decodes right. It returns nothing while a token ends inside a UTF-8 character, so a partial
character is never emitted; `flush` decodes whatever is still pending at the end. Stop strings are
searched only where new text could form one, and, as in vLLM, only once the output has more than
`min_tokens` tokens (one completed earlier does not end it).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5               # prompt tokens the stream starts from


def backend_of(tokenizer):
    """The `tokenizers.Tokenizer` under a Hugging Face tokenizer (ValueError without one)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer; conveyor needs one "
                         f"(a tokenizer.json)")
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0):
        self.backend = None if tokenizer is None else backend_of(tokenizer)   # None: ids only
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.stream_ = DecodeStream(context, skip_special_tokens)
        self.recent = context                  # decoded tokens, then the pending ones
        self.num_pending = 0                   # tokens at the end of `recent` not yet in text
        self.text = ""
        self.stop = stop or []
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_tokens = 0                    # generated tokens pushed
        self.stopped_by: str | None = None     # the stop string that ended the text, if any
        self._streamed = 0                     # characters of `text` already handed out

    def push(self, new_ids: list[int]) -> int:
        """Add generated tokens; sets `stopped_by` when a stop string appears. Returns how many
        of them the text takes: all, or up to the one that completed a stop string (several
        tokens come at once with speculative decoding; the rest are dropped)."""
        if self.stopped_by is not None:
            return 0
        if self.backend is None:
            return len(new_ids)
        for i, token in enumerate(new_ids):
            self.num_tokens += 1
            piece = self.stream_.step(self.backend, token)
            self.recent.append(token)
            if piece is None:
                self.num_pending += 1
                continue
            del self.recent[:-_CONTEXT_TOKENS]
            self.num_pending = 0
            if piece and self._append(piece):
                return i + 1
        return len(new_ids)

    def flush(self) -> None:
        """At the end: tokens still pending (a partial character) are decoded, replacement
        marks and all."""
        if self.stopped_by is None and self.backend is not None and self.num_pending:
            decode = self.backend.decode
            done = self.recent[:-self.num_pending]
            full = decode(self.recent, skip_special_tokens=self.skip_special_tokens)
            prefix = decode(done, skip_special_tokens=self.skip_special_tokens)
            self.num_pending = 0
            self._append(full[len(prefix):])

    def stream(self, final: bool = False) -> str:
        """Text not yet handed out, minus a tail that could still grow into a stop string."""
        end = len(self.text) if final or self.stopped_by is not None else self._safe_end()
        delta = self.text[self._streamed:end]
        self._streamed = max(self._streamed, end)
        return delta

    def _append(self, piece: str) -> bool:
        self.text += piece
        if not self.stop or self.num_tokens <= self.min_tokens:
            return False
        start = max(0, len(self.text) - len(piece) - self.max_stop + 1)
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
        for n in range(min(len(self.text), self.max_stop - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return len(self.text) - n
        return len(self.text)
