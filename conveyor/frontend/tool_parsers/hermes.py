"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): content, then calls in tags, e.g.

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A missing closing tag is tolerated (the object's end ends the call).
"""
from __future__ import annotations

from conveyor.frontend.tool_parsers.base import ToolParser

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    def _step(self, final: bool) -> bool:
        if self.mode in ("start", "text"):
            if not self._text_until(START, final):
                return False
            self._begin_call(START)
            self.mode = "call"
        elif self.mode == "call":
            return self._call_step(then="close")
        else:                                   # "close": the closing tag after the object
            body = self.buf.lstrip()
            if body.startswith(END):
                self.buf, self.mode = body[len(END):], "text"
            elif not final and len(body) < len(END) and END.startswith(body):
                return False
            else:
                self.buf, self.mode = body, "text"
        return True
