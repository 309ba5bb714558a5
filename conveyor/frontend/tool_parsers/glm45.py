"""GLM-4.5 / 4.6 / 4.7 calls: content, then calls in Hermes's `<tool_call>` tags, each the
function's name and its arguments as key and value tags:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 may write the first `<arg_key>` right after the name.) The name, keys and values are
taken without the whitespace around them; a value is typed by the function's schema as
Qwen3-Coder's are (qwen3_coder.py: a string stays a string, another type is read as JSON, then
as a Python literal, else kept as a string), which is how GLM's chat template writes them
(strings raw, the rest as JSON). A stream sends the name once its line ends (or a tag follows
it), and each argument once its `</arg_value>` arrives.
"""
from __future__ import annotations

import re

from conveyor.frontend.tool_parsers.hermes import END
from conveyor.frontend.tool_parsers.qwen3_coder import Qwen3CoderParser, XmlCall

_WS = " \t\n\r"
_NAME = re.compile(r"[\w.\-]+")
_TAGS = {"body": (("<arg_key>", "key"), (END, "done")), "between": (("<arg_value>", "value"),)}
_CLOSE = {"key": "</arg_key>", "value": "</arg_value>"}


class Glm45Parser(Qwen3CoderParser):
    def _new_call(self) -> GlmCall:
        return GlmCall(self.schemas)


class GlmCall(XmlCall):
    """The name, then `<arg_key>K</arg_key>` `<arg_value>V</arg_value>` pairs, up to and with
    `</tool_call>` (a text could hold all of it before the parser saw the tag): start body key
    between value."""

    def _advance(self) -> bool:
        """Read the next name, tag, key or value; False to wait for more text."""
        rest = self.text[self._pos:]
        if self.state == "start":                  # the name: up to its line's end or a tag
            ends = [i for i in (rest.find("\n"), rest.find("<")) if i >= 0]
            if not ends:
                if not _NAME.fullmatch(rest.strip(_WS) or "x"):
                    self.state = "error"
                return False
            name = rest[:min(ends)].strip(_WS)
            if not _NAME.fullmatch(name):
                self.state = "error"
                return False
            self.name, self.state = name, "body"
            self._pos += min(ends)
            return True
        if self.state in _CLOSE:                   # a key or a value, up to its closing tag
            close = _CLOSE[self.state]
            end = self.text.find(close, max(self._pos, self._looked))
            if end < 0:
                self._looked = len(self.text) - len(close) + 1
                return False
            text, self._pos = self.text[self._pos:end].strip(_WS), end + len(close)
            if self.state == "key":
                self._key, self.state = text, "between" if text else "error"
                return bool(text)
            self.state = "body"
            return self._add(self._key, self._typed(text))
        return self._tag(rest, _TAGS[self.state])        # body, between
