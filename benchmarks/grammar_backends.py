"""xgrammar against llguidance on one tokenizer: how long a grammar takes to compile, and how long
filling the token bitmask of a batch takes per decode step.

Compile: a nested JSON schema (objects, an enum, an array, required fields), any JSON object
(`json_object`), a regex and a choice, each compiled fresh (no cache) REPEAT times; the median.
xgrammar precomputes its token-mask cache when it compiles; llguidance builds its lexer lazily, so
its first masks cost more: `first mask` is compile plus the first bitmask, what a new request
waits before its first token can be sampled.

Mask fill: BATCH matchers of the JSON schema walk the tokens of one valid document (each starts at
a different position, so the batch holds varied states); every step fills the [BATCH, V/32]
bitmask for all of them at once (each library's multi-threaded batch call), then each matcher
consumes its next token. Reported: the median step, and per token (the step over BATCH).

    python scripts/bench_grammar_backends.py [--model GGUF] [--batch 1,64,256] [--steps 64]

xgrammar is not a dependency of conveyor (pip install xgrammar to compare); a missing library's
rows say so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"type": "string", "enum": ["active", "inactive", "banned"]},
        "email": {"type": "string"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "scores": {"type": "array", "items": {"type": "number"}},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "status", "address", "tags", "verified"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "status": "active", "email": "ada@example.org",
            "address": {"street": "12 St James's Square", "city": "London", "zip": "02115"},
            "tags": ["math", "engines", "poetry"], "scores": [9.5, 8.25, 10],
            "verified": True}
REGEX = r"(\+1 )?\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}"
CHOICE = ["positive", "negative", "neutral", "mixed feelings"]


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.lib, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(threads)
        self.vocab_size = vocab_size

    def grammars(self) -> dict[str, str]:
        m = self.lib.LLMatcher
        return {"json schema": m.grammar_from_json_schema(json.dumps(SCHEMA)),
                "json_object": m.grammar_from_json_schema('{"type": "object"}'),
                "regex": m.grammar_from_regex(REGEX),
                "choice": m.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in CHOICE))}

    def compile(self, grammar: str):
        m = self.lib.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, batch: int):
        return self.np.allocate_token_bitmask(batch, self.vocab_size)

    def fill_one(self, matcher, bitmask) -> None:
        self.np.fill_next_token_bitmask(matcher, bitmask, 0)

    def fill(self, matchers, bitmask) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                            bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, threads: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(threads)
        self.vocab_size = vocab_size
        self._sources = {"json schema": lambda: self.compiler.compile_json_schema(
                             json.dumps(SCHEMA), any_whitespace=False),
                         "json_object": self.compiler.compile_builtin_json_grammar,
                         "regex": lambda: self.compiler.compile_regex(REGEX),
                         "choice": lambda: self.compiler.compile_grammar(
                             "root ::= " + " | ".join(json.dumps(c) for c in CHOICE))}

    def grammars(self) -> dict[str, str]:
        return {k: k for k in self._sources}

    def compile(self, grammar: str):
        return self._sources[grammar]()

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill_one(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


def bench_backend(backend, doc_tokens: list[int], batches: list[int], steps: int,
                  repeat: int) -> dict:
    out = {"compile_ms": {}, "first_mask_ms": {}, "fill": {}}
    for kind, grammar in backend.grammars().items():
        out["compile_ms"][kind] = _median_ms(lambda g=grammar: backend.compile(g), repeat)

        def first_mask(g=grammar):
            m = backend.new_matcher(backend.compile(g))
            backend.fill_one(m, backend.bitmask(1))
        out["first_mask_ms"][kind] = _median_ms(first_mask, repeat)
    compiled = backend.compile(backend.grammars()["json schema"])
    n = len(doc_tokens)
    for batch in batches:
        # matcher i starts i positions into the document (up to the document's length)
        starts = [i % max(1, n - steps - 1) for i in range(batch)]
        matchers = [backend.new_matcher(compiled) for _ in range(batch)]
        for m, s in zip(matchers, starts):
            for t in doc_tokens[:s]:
                backend.accept(m, t)
        bitmask = backend.bitmask(batch)
        times = []
        for step in range(min(steps, n - max(starts) - 1)):
            t = time.perf_counter()
            backend.fill(matchers, bitmask)
            times.append(time.perf_counter() - t)
            for m, s in zip(matchers, starts):
                backend.accept(m, doc_tokens[s + step])
        step_ms = statistics.median(times) * 1e3
        out["fill"][batch] = {"step_ms": step_ms, "per_token_us": step_ms * 1e3 / batch,
                              "steps": len(times)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: the default model)")
    ap.add_argument("--batch", default="1,64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    from conveyor.frontend.tokenizer import load_tokenizer
    from conveyor.shared.model_files import read_model_config, resolve_model

    files = resolve_model(args.model)
    vocab_size = read_model_config(files).vocab_size
    tokenizer = load_tokenizer(files)
    doc_tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    batches = [int(b) for b in args.batch.split(",")]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{args.threads} threads; vocabulary {vocab_size}; document {len(doc_tokens)} tokens")
    results = {}
    for cls in (LLGuidance, XGrammar):
        try:
            backend = cls(tokenizer, vocab_size, args.threads)
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
            continue
        results[cls.name] = bench_backend(backend, doc_tokens, batches, args.steps, args.repeat)
    print("\ncompile (ms, median; first mask: compile + the first bitmask)")
    kinds = ["json schema", "json_object", "regex", "choice"]
    print(f"{'backend':<12}" + "".join(f"{k:>24}" for k in kinds))
    for name, r in results.items():
        print(f"{name:<12}" + "".join(
            f"{r['compile_ms'][k]:>11.2f} / {r['first_mask_ms'][k]:>7.2f} ms" for k in kinds))
    print("\nbitmask fill per step, JSON schema (ms a step; µs a token)")
    print(f"{'backend':<12}" + "".join(f"{'batch ' + str(b):>22}" for b in batches))
    for name, r in results.items():
        print(f"{name:<12}" + "".join(
            f"{r['fill'][b]['step_ms']:>11.3f} ms {r['fill'][b]['per_token_us']:>6.1f} µs"
            for b in batches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
