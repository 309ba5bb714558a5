"""Qwen3-Coder calls: content, then calls in Hermes's `<tool_call>` tags with an XML body:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline either side dropped), turned into JSON by its type in
the function's schema from the request's tools: a string stays a string; another type is read as
JSON, then as a Python literal, else kept as a string; a parameter the schema does not name is
read as JSON, else kept as a string. A stream sends the name once `<function=NAME>` is complete,
and each parameter once its `</parameter>` arrives (a value is whole only then).
"""
from __future__ import annotations

import ast
import json

from conveyor.frontend.tool_parsers.hermes import HermesParser
from conveyor.frontend.tool_parsers.keyword_call import KeywordCall, dumps

_WS = " \t\n\r"
_TAGS = {"start": (("<function=", "name"),),
         "body": (("<parameter=", "param"), ("</function>", "done"))}
VALUE_END = "</parameter>"


class Qwen3CoderParser(HermesParser):
    def __init__(self, tools: tuple[dict, ...] = ()) -> None:
        super().__init__(tools)
        self.schemas = {f["name"]: f.get("parameters") or {} for f in tools}

    def _new_call(self) -> XmlCall:
        return XmlCall(self.schemas)


class XmlCall(KeywordCall):
    """`<function=NAME>` and its `<parameter=KEY>VALUE</parameter>`s, up to `</function>`:
    start name body param value. TAGS: what opens a name or key, and what ends the call."""

    TAGS = _TAGS

    def __init__(self, schemas: dict[str, dict]) -> None:
        super().__init__()
        self.schemas = schemas              # function name -> its parameters' JSON schema
        self._pos = 0                       # the text before this is read
        self._looked = 0                    # no VALUE_END starts before this
        self._key = ""

    def feed(self, s: str) -> int:
        self.text += s
        while self.state not in ("done", "error") and self._advance():
            pass
        if self.state not in ("done", "error"):
            return len(s)
        beyond = len(self.text) - self._pos     # the text after the call's end (or its break)
        self.text = self.text[:self._pos]
        return max(0, len(s) - beyond)

    def _advance(self) -> bool:
        """Read the next tag, name or value; False to wait for more text."""
        if self.state == "value":
            end = self.text.find(VALUE_END, max(self._pos, self._looked))
            if end < 0:
                self._looked = len(self.text) - len(VALUE_END) + 1
                return False
            value, self._pos = self.text[self._pos:end], end + len(VALUE_END)
            self.state = "body"
            return self._add(self._key, self._typed(value))
        rest = self.text[self._pos:]
        if self.state in ("name", "param"):
            end = rest.find(">")
            word = rest[:end] if end >= 0 else rest
            if "<" in word or "\n" in word or (end >= 0 and not word.strip()):
                self.state = "error"
            if end < 0 or self.error:
                return False
            self._pos += end + 1
            word = self._word(word)
            if word is None:
                self.state = "error"
                return False
            if self.state == "name":
                self.name, self.state = word, "body"
            else:
                self._key, self.state = word, "value"
            return True
        return self._tag(rest, self.TAGS[self.state])    # start, body

    def _word(self, word: str) -> str | None:
        """A name or key as written between its tag and the `>` (None: not one)."""
        return word.strip()

    def _tag(self, rest: str, tags: tuple[tuple[str, str], ...]) -> bool:
        """Whitespace, then one of `tags` ((tag, the state after it)): True once it is read,
        False to wait for more text (the call breaks if none of them can follow)."""
        body = rest.lstrip(_WS)
        self._pos += len(rest) - len(body)
        for tag, then in tags:
            if body.startswith(tag):
                self._pos += len(tag)
                self.state = then
                return True
        if not any(tag.startswith(body) for tag, _ in tags):
            self.state = "error"
        return False

    def _typed(self, raw: str) -> str:
        """A parameter's value as JSON text, by its type in the function's schema."""
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        props = self.schemas.get(self.name, {}).get("properties")
        schema = props.get(self._key) if isinstance(props, dict) else None
        kind = schema.get("type") if isinstance(schema, dict) else None
        if "string" in (kind if isinstance(kind, list) else [kind]):
            return dumps(raw)
        readers = (json.loads,) if kind is None else (json.loads, ast.literal_eval)
        for read in readers:
            try:
                return dumps(read(raw))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
        return dumps(raw)
