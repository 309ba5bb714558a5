"""One sequence's grammar state (`SeqGrammar`): its matcher and the phases of its output (a
thought before the constraint, an optional thought's opening), as its tokens arrive.
`GrammarCompiler.start` (shared/grammar.py) makes one; worker/structured.py keeps it beside the
sequence's sampling state. No torch here.
"""
from __future__ import annotations

import copy
import logging
from concurrent.futures import Future

log = logging.getLogger(__name__)


class SeqGrammar:
    """One sequence's matcher. Accepted tokens wait in `pending` until the next fill consumes
    them (`GrammarCompiler.fill_bitmask`, on the engine's fill thread): the step loop only
    appends. A resumed sequence replays its output so far through `accept`. With `start_after`
    the sequence is `free` (no mask, the matcher does not move) until those token ids have been
    accepted in a row; the grammar applies from the next token. With `thought_open` too, the
    sequence is `opening` until its output either begins with those ids (then free, a thought)
    or leaves them (no thought: the grammar holds from the first token, as its masks did)."""

    def __init__(self, compiled: Future, tokens: list[int], start_after: list[int] | None = None,
                 thought_open: list[int] | None = None):
        self._compiled = compiled
        self.pending: list[int] = []
        self.matcher = None
        self._start = list(start_after) if start_after else None
        self._tail: list[int] = []           # the last len(start_after) tokens, while free
        self._open = list(thought_open) if self._start and thought_open else None
        self.opened = 0                      # how many of thought_open's ids came, while opening
        for t in tokens:
            self.accept(t)

    @property
    def free(self) -> bool:
        """The constraint has not started yet: every token is allowed."""
        return self._start is not None and self._open is None

    @property
    def opening(self) -> list[int] | None:
        """thought_open while the output is a prefix of it (its mask: the grammar's after that
        prefix, if the grammar takes it, and the next id of thought_open), else None."""
        return self._open

    def forked(self) -> SeqGrammar:
        """A copy of the phase (no matcher) to walk guesses through."""
        fork = copy.copy(self)
        fork.matcher, fork._compiled = None, None
        fork.pending, fork._tail = [], list(self._tail)
        fork._start = self._start and list(self._start)
        fork._open = self._open and list(self._open)
        return fork

    def accept(self, token: int) -> None:
        if self._open is not None:
            if token == self._open[self.opened]:
                self.opened += 1
                if self.opened == len(self._open):
                    self._open = None        # a thought: free until start_after
                return
            self.pending += self._open[:self.opened] + [token]
            self._open = self._start = None  # no thought: constrained from the first token
            return
        if self._start is not None:
            self._tail.append(token)
            if len(self._tail) > len(self._start):
                del self._tail[0]
            if self._tail == self._start:
                self._start, self._tail = None, []
        else:
            self.pending.append(token)

    def compiled(self):
        """The sequence's own matcher (waits for the compile; `pending` not consumed); None if
        the compile failed (then the sequence may only end)."""
        if self.matcher is None and self._compiled is not None:
            try:
                self.matcher = self._compiled.result().deep_copy()
            except Exception:
                log.exception("a grammar could not be compiled; its sequence gets EOS only")
                self._compiled = None
        return self.matcher

    def ready(self):
        """compiled(), with every accepted token consumed."""
        m = self.compiled()
        if m is not None:
            for t in self.pending:
                _consume(m, t)
        self.pending = []
        return m


def live(m) -> bool:
    """Whether the matcher takes tokens: not past its end (e.g. the token planned after EOS,
    which the scheduler drops) nor broken."""
    return not (m.is_stopped() or m.is_error())


def _consume(m, token: int) -> None:
    if live(m) and not m.consume_token(token):
        broken(m, token)


def broken(m, token: int) -> None:
    # NOTE: only a row its constraints leave no token draws outside the mask (EOS, which ends
    # it: worker/logit_edits.py); from here on it allows only EOS.
    log.warning("a sampled token %d broke its grammar: %s", token,
                m.get_error().splitlines()[0] if m.get_error() else "")
