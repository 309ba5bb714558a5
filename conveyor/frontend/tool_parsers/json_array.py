"""Calls as a JSON array of objects, `[{"name": ..., "parameters": {...}}, ...]`.

This is what a request with tool_choice "required" is constrained to produce (the layout vLLM
uses), and, after its marker, Mistral's layout. Here the array must open the output.
"""
from __future__ import annotations

from conveyor.frontend.tool_parsers.base import ToolParser


class JsonArrayParser(ToolParser):
    after_array = "plain"                    # what the text after `]` is read as

    def _step(self, final: bool) -> bool:
        if self.mode == "start":
            return self._open_array(final, marker="")
        return self._array_step(final)

    def _open_array(self, final: bool, marker: str) -> bool:
        """At `[` followed by a call: read calls; anything else there is content."""
        body = self.buf.lstrip()
        inner = body[1:].lstrip() if body.startswith("[") else body
        if not final and (not body or (body.startswith("[") and not inner)):
            return False
        if not (body.startswith("[") and self._opens_call(inner)):
            if marker:
                self._content(marker)
            self.mode = "plain"
            return True
        self._begin_call(marker + self.buf[:len(self.buf) - len(inner)])
        self.buf, self.mode = inner, "call"
        return True

    def _opens_call(self, inner: str) -> bool:
        """Whether the text after `[` starts a call (a family with other calls says its own)."""
        return inner.startswith("{")

    def _array_step(self, final: bool) -> bool:
        if self.mode == "call":
            return self._call_step(then="next")
        return self._next_call(",", "]", then=self.after_array)     # "next"
