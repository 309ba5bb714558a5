"""Pythonic calls (Llama 3.2, Llama 4 and others): a Python list of calls with keyword arguments
whose values are literals, after an optional `<|python_start|>` (Llama 4, ended by
`<|python_end|>`):

    [get_weather(city="Paris", days=3), get_time(tz='CET')]

The client gets the arguments as JSON (`{"city": "Paris", "days": 3}`). Each value is read with
`ast.literal_eval`, so one that is not a literal (a name, an expression) is not a call. A call's
name goes out with its first argument (or its `)`), and each argument once its value is complete.
Without the tag the list must open the output; with it, content may come first. A list the
output leaves open is cut like a call cut off after its name (a whole reply: all content).
"""
from __future__ import annotations

import ast

from conveyor.frontend.tool_parsers.base import Delta
from conveyor.frontend.tool_parsers.json_array import JsonArrayParser
from conveyor.frontend.tool_parsers.keyword_call import KeywordCall, dumps

START, END = "<|python_start|>", "<|python_end|>"
_WS = " \t\n\r"


class PythonicParser(JsonArrayParser):
    after_array = "end"

    def _new_call(self) -> PythonCall:
        return PythonCall()

    def _opens_call(self, inner: str) -> bool:
        return inner[:1].isidentifier()

    def _step(self, final: bool) -> bool:
        if self.mode == "start":                # the list, the tag, or content
            body = self.buf.lstrip()
            if not final and len(body) < len(START) and START.startswith(body):
                return False
            if body.startswith("["):
                return self._open_array(final, marker="")
            self.mode = "text"
        elif self.mode == "text":
            if not self._text_until(START, final):
                return False
            self.mode = "tag"
        elif self.mode == "tag":
            return self._open_array(final, marker=START)
        elif self.mode == "end":                # after `]`: drop the closing tag
            body = self.buf.lstrip()
            if not final and len(body) < len(END) and END.startswith(body):
                return False
            self.buf = body[len(END):] if body.startswith(END) else body
            self.mode = "text"
        else:
            return self._array_step(final)
        return True

    def finish(self) -> Delta:
        out = super().finish()
        if self.mode == "next":                 # the output ended inside the list
            self.broken = True
        return out


class PythonCall(KeywordCall):
    """`name(key=value, ...)`, read character by character: start name key kw eq value."""

    def __init__(self) -> None:
        super().__init__()
        self._start = 0                     # where the name, keyword or value began
        self._key = ""
        self._depth = 0                     # brackets open in the value
        self._quote = ""                    # the open string's quote: ' " ''' or """
        self._opened = -1                   # where the open string's quote is
        self._run = 0                       # closing quote characters seen in a row
        self._esc = False
        self._empty_end = -2                # where an empty string ('' or "") closed

    def name_checked(self) -> bool:
        return self.name is not None and (bool(self._json) or self.done)

    def feed(self, s: str) -> int:
        at = len(self.text)
        self.text += s
        for i, ch in enumerate(s):
            if self.state in ("done", "error"):
                self.text = self.text[:at + i]
                return i
            self._step(ch, at + i)
        return len(s)

    def _step(self, ch: str, pos: int) -> None:
        state = self.state
        if state == "value":
            self._value(ch, pos)
        elif state == "start" and ch.isidentifier():
            self.state, self._start = "name", pos
        elif state in ("name", "kw") and self.text[self._start:pos + 1].isidentifier():
            pass
        elif state == "name" and ch == "(":
            self.name, self.state = self.text[self._start:pos], "key"
        elif state in ("key", "eq") and ch in _WS:
            pass
        elif state == "key" and ch == ")":
            self.state = "done"
        elif state == "key" and ch.isidentifier():
            self.state, self._start = "kw", pos
        elif state == "kw" and (ch in _WS or ch == "="):
            self._key = self.text[self._start:pos]
            self.state = "eq" if ch != "=" else "value"
            self._start = pos + 1
        elif state == "eq" and ch == "=":
            self.state, self._start = "value", pos + 1
        else:
            self.state = "error"

    def _value(self, ch: str, pos: int) -> None:
        """Follow the value's strings and brackets to the `,` or `)` that ends it."""
        if self._quote:
            if self._esc:
                self._esc, self._run = False, 0
            elif ch == "\\":
                self._esc, self._run = True, 0
            elif ch == self._quote[0]:
                self._run += 1
                if self._run == len(self._quote):
                    if pos == self._opened + 1:
                        self._empty_end = pos
                    self._quote = ""
            else:
                self._run = 0
        elif ch in "'\"":
            # NOTE: an empty string followed by its quote again was the start of ''' or """
            triple = pos == self._empty_end + 1 and self.text[pos - 1] == ch
            self._quote, self._opened, self._run = ch * 3 if triple else ch, pos, 0
        elif ch in "([{":
            self._depth += 1
        elif ch in ")]}" and self._depth:
            self._depth -= 1
        elif (ch == "," or ch == ")") and not self._depth:
            if self._end_value(self.text[self._start:pos]):
                self.state = "key" if ch == "," else "done"
        elif ch in "]}":
            self.state = "error"

    def _end_value(self, raw: str) -> bool:
        try:
            if not raw.strip():
                raise ValueError("no value")
            # in parentheses, as in the call, so that a value may span lines
            value = dumps(ast.literal_eval("(" + raw + "\n)"))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self.state = "error"
            return False
        return self._add(self._key, value)
