"""Grammars for structured outputs, on llguidance (docs/STRUCTURED_OUTPUTS.md says why it).

`check` is the frontend's: it turns a StructuredOutputs into an llguidance grammar and validates
it without a tokenizer, so a bad schema, regex or grammar is a 400 before anything reaches the
engine. `GrammarCompiler` is worker rank 0's: it compiles grammars for the model's vocabulary on
a thread pool (off the step loop; llguidance drops the GIL), caches them by key, and gives each
sequence a `SeqGrammar` (shared/seq_grammar.py) that follows its tokens. `fill_bitmask` fills
a batch's token bitmask (bit t of row r set: token t is allowed) on llguidance's threads. No
torch here.
"""
from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from conveyor.shared.seq_grammar import SeqGrammar, broken, live
from conveyor.shared.structured_outputs import StructuredOutputs

log = logging.getLogger(__name__)

CACHE_SIZE = 512                             # compiled grammars kept, least recently used out
# NOTE: compact JSON (", " and ": " between items, no other whitespace): a model may not pad its
# output with whitespace until max_tokens runs out, as small models given the freedom do.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "choice": "choice", "grammar": "grammar"}


def to_grammar(so: StructuredOutputs) -> str:
    """llguidance's grammar text for `so` (not validated)."""
    from llguidance import LLMatcher, grammar_from

    kind = so.kind
    if kind == "json":
        schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in so.choice))
    return grammar_from("grammar", so.grammar)   # Lark as it is; GBNF converted to Lark


_checked: OrderedDict[tuple[str, str], str] = OrderedDict()   # key -> error ("" if none)
_checked_lock = threading.Lock()


def check(so: StructuredOutputs) -> None:
    """ValueError naming the problem if `so` cannot be compiled (results cached by key)."""
    from llguidance import LLMatcher

    key = so.key()
    with _checked_lock:
        error = _checked.get(key)
        if error is not None:
            _checked.move_to_end(key)
    if error is None:
        try:
            error = LLMatcher.validate_grammar(to_grammar(so))
        except ValueError as e:
            error = str(e) or "invalid"
        with _checked_lock:
            _checked[key] = error
            if len(_checked) > CACHE_SIZE:
                _checked.popitem(last=False)
    if error:
        raise ValueError(f"the {_WHAT[so.kind]} of structured_outputs is invalid: "
                         f"{error.strip()}")


# NOTE: llguidance's "slices": token classes (the first regex a token matches whole) whose
# tokens a mask allows at once when the grammar's lexer allows the whole regex there, instead
# of walking them through the token trie. The library's default has string bodies of 1-10,
# 1-30 and any length; JSON strings with a maxLength (and the tail of any bounded string)
# leave most of a vocabulary to the walk once fewer characters are left than a class's bound.
# Classes of 1-4, 6, 8, ... 30 characters cut the fill of 64 real JSON outputs of the default
# model by 18-20 % (4.2-4.5 against 5.2-5.6 ms a step on 2 threads), the same masks; regex,
# choice and Lark masks within +-8 us (docs/BENCHMARKS.md, "Structured outputs").
_STRING_BODY = r'[^"\\\x00-\x1F\x7F]'
SLICES = ([r"[\x20\x0A\x0D\x09]+"]
          + [f"{_STRING_BODY}{{1,{n}}}" for n in (1, 2, 3, 4, 6, 8, 10, 15, 20, 25, 30)]
          + [f"{_STRING_BODY}+"])


def build_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's view of a Hugging Face fast tokenizer (about a second), with SLICES.

    NOTE: some converters (transformers' GGUF reader, for one) wrap a byte-level BPE's decoder
    in a Sequence with SentencePiece steps; llguidance then reads "Ġ" as two bytes, not a space,
    and its masks disagree with the text. The ByteLevel decoder alone is what such a vocabulary
    means, so the view is built from that, and checked on the space-led tokens.
    """
    import llguidance

    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            spec["decoder"] = byte_level[0]
    view = llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids),
                                  slices=SLICES)
    if decoder and "ByteLevel" in json.dumps(decoder):
        spaced = [i for t, i in hf_tokenizer.get_vocab().items()
                  if t.startswith("\u0120") and i < vocab_size][:64]
        wrong = [i for i in spaced if not view.decode_bytes([i]).startswith(b" ")]
        if wrong:
            raise ValueError(f"the grammar library reads token {wrong[0]} of this tokenizer "
                             f"as {view.decode_bytes([wrong[0]])!r}, not a space-led word: its "
                             f"decoder ({decoder.get('type')}) is not understood")
    return view


# NOTE: one fill thread. On the H200's 16-core host, beside the engine's step loop, llguidance's
# parallel fill got slower with each thread added: 64 rows of the typical schema 1.00 ms on 1
# thread, 1.09 on 2, 1.10 on 4, 1.38 on 8 (bounded strings 3.85 against 5.66 ms; 256 rows 3.26
# against 4.38 ms), and the engine's constrained decode was no slower (docs/BENCHMARKS.md).
FILL_THREADS = 1


class GrammarCompiler:
    """Compiles grammars for one vocabulary on `threads` threads (the tokenizer may be a Future,
    built while the model loads) and fills masks on `fill_threads`."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 threads: int | None = None, fill_threads: int = FILL_THREADS):
        import llguidance

        threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_row = np.zeros(bitmask_width(vocab_size), dtype=np.int32)   # EOS only
        for t in eos_token_ids:
            self._eos_row.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self.executor = llguidance.LLExecutor(fill_threads)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.num_compiled = 0

    @property
    def tokenizer(self):
        t = self._tokenizer
        return t.result() if isinstance(t, Future) else t

    def compile(self, so: StructuredOutputs) -> Future:
        """A Future of the compiled (fresh) matcher of `so`: cached by key, else started now."""
        key = so.key()
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            return fut
        fut = self._cache[key] = self._pool.submit(self._compile, so)
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return fut

    def _compile(self, so: StructuredOutputs):
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, to_grammar(so), log_level=0)
        self.num_compiled += 1
        if m.is_error():   # the frontend checked it; a grammar it passed may still fail here
            log.warning("a grammar failed to compile: %s", m.get_error())
        return m

    def start(self, so: StructuredOutputs, tokens: list[int]) -> SeqGrammar:
        """A matcher for a sequence whose output so far is `tokens` (compiled now, also when the
        constraint starts later: it is then ready when needed)."""
        return SeqGrammar(self.compile(so), tokens, so.start_after, so.thought_open)

    def fill_bitmask(self, grammars: list[SeqGrammar], bitmask: np.ndarray,
                     guesses: list[list[int]] | None = None) -> None:
        """Row i of bitmask [>= len(grammars), ceil(V / 32)] int32 gets grammars[i]'s mask,
        after each grammar consumes its accepted tokens (a `free` one, a thought, comes only
        with guesses, which may end it: its rows allow everything until then). A decode step's
        one token each is consumed by one parallel call, which like the fill runs without the
        GIL, so on the engine's fill thread neither holds up the step loop (64 matchers
        advanced one at a time took 0.3 ms of it a step).

        With `guesses` (speculative decoding) grammars[i] takes len(guesses[i]) + 1 rows, back
        to back: its mask, then the mask after each of its guesses in turn (the matcher steps
        through them and back). Rows past a guess the grammar refuses allow only EOS: that
        guess's own row does not allow it, so verification stops there and never draws from
        them."""
        from llguidance.numpy import fill_next_token_bitmask_par

        first = (list(itertools.accumulate((len(g) + 1 for g in guesses[:-1]), initial=0))
                 if guesses else range(len(grammars)))
        matchers, singles, guessed, walks = [], [], [], []
        for i, g in enumerate(grammars):
            m = g.compiled()
            guess = guesses[i] if guesses else []
            if g.opening is not None or g.free:  # a thought's start, or guesses that may end it
                walks.append((g, first[i], guess))
                continue
            if m is not None and len(g.pending) == 1 and live(m):
                singles.append((m, g.pending.pop()))
            else:
                m = g.ready()                # a replayed output one by one, or nothing
            if m is None:
                bitmask[first[i]:first[i] + len(guess) + 1] = self._eos_row
            else:
                matchers.append((m, first[i]))
                if guess:
                    guessed.append((m, first[i], guess))
        if singles:
            for (m, token), ok in zip(singles, self.executor.consume_token_par(singles)):
                if not ok:
                    broken(m, token)
        if matchers:
            fill_next_token_bitmask_par(self.executor, matchers, bitmask)
        if guessed:
            self._fill_guessed(guessed, bitmask)
        for g, row, guess in walks:
            self._fill_walk(g, row, guess, bitmask)

    def _fill_walk(self, g: SeqGrammar, row: int, guess: list[int], bitmask: np.ndarray) -> None:
        """The rows of a grammar whose phase may change within this step (its output a prefix
        of a thought's opening, or a thought its guesses may end), one at a time: each row the
        mask after the guesses before it, as the sequence would take them. Rare: the first few
        tokens of a request, or guesses of a thought."""
        from llguidance.numpy import fill_next_token_bitmask

        m = g.ready()
        walk = g.forked()
        consumed = 0
        for d in range(len(guess) + 1):
            r = row + d
            if walk.free:
                bitmask[r] = -1
            elif m is None:
                bitmask[r:row + len(guess) + 1] = self._eos_row
                break
            elif walk.opening is not None:
                ids, n = walk.opening, walk.opened
                bitmask[r] = 0
                if not n or (live(m) and m.validate_tokens(ids[:n]) == n):  # held so far
                    if n:
                        m.consume_tokens(ids[:n])
                    fill_next_token_bitmask(m, bitmask, r)
                    if n:
                        m.rollback(n)
                bitmask.view(np.uint32)[r, ids[n] // 32] |= np.uint32(1 << (ids[n] % 32))
            else:
                todo, walk.pending = walk.pending, []
                if todo and not (live(m) and m.validate_tokens(todo) == len(todo)):
                    bitmask[r:row + len(guess) + 1] = self._eos_row   # past a refused guess
                    break
                if todo:
                    m.consume_tokens(todo)
                    consumed += len(todo)
                fill_next_token_bitmask(m, bitmask, r)
            if d < len(guess):
                walk.accept(guess[d])
        if consumed:
            m.rollback(consumed)

    def _fill_guessed(self, rows: list, bitmask: np.ndarray) -> None:
        """The rows after each (matcher, first row, guesses)'s first: one parallel fill per
        depth over the matchers that took that many guesses, then each matcher rolled back."""
        from llguidance.numpy import fill_next_token_bitmask_par

        valid = []
        for m, row, guess in rows:
            v = m.validate_tokens(guess) if live(m) else 0
            bitmask[row + v + 1:row + len(guess) + 1] = self._eos_row
            valid.append(v)
        # NOTE: a matcher that stopped (its grammar complete) takes no more tokens, EOS
        # included, and its mask allows only EOS: only the tokens it consumed are rolled back
        consumed = [0] * len(rows)
        for depth in range(1, max(valid, default=0) + 1):
            level = []
            for i, ((m, row, guess), v) in enumerate(zip(rows, valid)):
                if v >= depth:
                    if live(m):
                        m.consume_token(guess[depth - 1])
                        consumed[i] += 1
                    level.append((m, row + depth))
            fill_next_token_bitmask_par(self.executor, level, bitmask)
        for (m, _, _), n in zip(rows, consumed):
            if n:
                m.rollback(n)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
