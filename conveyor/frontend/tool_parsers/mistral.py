"""Mistral calls: content, then `[TOOL_CALLS]` and a JSON array of calls:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

`[TOOL_CALLS]` is a special token, dropped from the text unless the request keeps special tokens
(skip_special_tokens: false); without it, an array of calls that opens the output is read as calls.
"""
from __future__ import annotations

from conveyor.frontend.tool_parsers.json_array import JsonArrayParser

MARKER = "[TOOL_CALLS]"


class MistralParser(JsonArrayParser):
    after_array = "text"

    def _step(self, final: bool) -> bool:
        if self.mode == "start":               # an array of calls without its marker?
            body = self.buf.lstrip()
            if not final and (not body or MARKER.startswith(body)):
                return False
            if body.startswith(MARKER):
                self.mode = "text"
                return True
            inner = body[1:].lstrip() if body.startswith("[") else None
            if inner == "" and not final:
                return False
            if inner is not None and inner.startswith("{"):
                return self._open_array(final, marker="")
            self.mode = "text"
            return True
        if self.mode == "text":
            if not self._text_until(MARKER, final):
                return False
            self.mode = "marker"
            return True
        if self.mode == "marker":
            return self._open_array(final, marker=MARKER)
        return self._array_step(final)
