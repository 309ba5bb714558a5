"""tool_choice names a function: the output is that function's arguments, a JSON object (the
request is constrained to the function's parameter schema), so the call is the whole output."""
from __future__ import annotations

from conveyor.frontend.tool_parsers.base import ToolParser, new_call_id


class NamedCallParser(ToolParser):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def _step(self, final: bool) -> bool:
        if self.mode == "start":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self._out.tool_calls.append({"index": 0, "id": new_call_id(), "type": "function",
                                         "function": {"name": self.name, "arguments": ""}})
            self.mode, self.num_calls = "arguments", 1
        body = self.buf.rstrip()                # trailing whitespace waits for what follows
        if body:
            self._out.tool_calls.append({"index": 0,
                                         "function": {"arguments": self._ws + body}})
            self._ws = self.buf[len(body):]
        else:
            self._ws += self.buf
        self.buf = ""
        return False

    def finish(self):
        self._ws = ""                           # the output's trailing whitespace is not JSON
        return super().finish()
