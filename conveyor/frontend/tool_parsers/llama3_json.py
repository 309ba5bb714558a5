"""Llama 3.1 / 3.2 JSON calls: the whole output is one or more objects separated by `;`,
after an optional `<|python_tag|>` (a special token, so usually absent from the text):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An output that does not start with `{` is content.
"""
from __future__ import annotations

from conveyor.frontend.tool_parsers.base import ToolParser

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    def _step(self, final: bool) -> bool:
        if self.mode == "start":
            body = self.buf.lstrip()
            if body.startswith(TAG):
                body = body[len(TAG):].lstrip()
                if not body and not final:
                    return False
            elif not final and (not body or TAG.startswith(body)):
                return False
            if not body.startswith("{"):
                self.mode = "plain"
                return True
            self._begin_call(self.buf[:len(self.buf) - len(body)])
            self.buf, self.mode = body, "call"
        elif self.mode == "call":
            return self._call_step(then="next")
        else:                                   # "next": `;` and another call, or the end
            return self._next_call(";")
        return True
