"""A request's output constraint (docs/STRUCTURED_OUTPUTS.md): a JSON schema, any JSON object, a
regex, a choice of strings or a grammar (Lark or GBNF/EBNF). Exactly one is set. `start_after`
(token ids) delays the constraint until those tokens have been generated: a reasoning model's
`</think>`, so that its thought is free and the answer is constrained. With `thought_open`
(`<think>`'s ids) as well, the thought is optional: an output that does not begin with those
ids has none, and the constraint holds from its first token.

It travels inside SamplingParams, so it needs nothing but msgspec: the grammar library is used
only where grammars are checked (the frontend) and run (worker rank 0): `shared/grammar.py`.
"""
from __future__ import annotations

import json

import msgspec

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputs(msgspec.Struct, omit_defaults=True, kw_only=True,
                        forbid_unknown_fields=True):
    json: str | dict | None = None           # a JSON schema, as JSON text or a dict
    json_object: bool = False                # any JSON object
    regex: str | None = None
    choice: list[str] | None = None          # exactly one of these strings
    grammar: str | None = None               # Lark, or GBNF (llama.cpp's EBNF)
    # the constraint applies from the token after the first appearance of these token ids in the
    # output (None: from the first token); the frontend sets the end of a reasoning model's thought
    start_after: list[int] | None = None
    # with start_after: the ids that open the thought; an output beginning otherwise has none
    thought_open: list[int] | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")
        for name in ("start_after", "thought_open"):
            ids = getattr(self, name)
            if ids is not None and (not ids or not all(type(t) is int and t >= 0 for t in ids)):
                raise ValueError(f"structured_outputs.{name} must be a non-empty list of token "
                                 "ids")
        if self.thought_open is not None and self.start_after is None:
            raise ValueError("structured_outputs.thought_open needs start_after")
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise ValueError(f"structured_outputs.{name} must not be empty")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the cache key): (kind, canonical text).
        `start_after` and `thought_open` are not part of it: they change when the grammar
        starts, not the grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = json.dumps(json.loads(value) if isinstance(value, str) else value,
                               sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value


def from_json_schema(schema: dict) -> StructuredOutputs:
    """The constraint that output is a JSON value satisfying `schema` (tool calls use it)."""
    return StructuredOutputs(json=schema)
