"""MiniMax-M2 calls: content, then one block of calls, each an `<invoke>` with its parameters:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

A value is typed by the function's schema as Qwen3-Coder's are (qwen3_coder.py: a string stays a
string, another type is read as JSON, then as a Python literal, else kept as a string). A stream
sends the name once its `<invoke name="...">` is complete, and each parameter once its
`</parameter>` arrives. Text after the block is content again.
"""
from __future__ import annotations

from conveyor.frontend.tool_parsers.qwen3_coder import Qwen3CoderParser, XmlCall

START, END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE = "<invoke name="
_WS = " \t\n\r"


class MiniMaxM2Parser(Qwen3CoderParser):
    def __init__(self, tools: tuple[dict, ...] = ()) -> None:
        super().__init__(tools)
        self._marker = ""                  # the block's opening tag, until its first call

    def _new_call(self) -> InvokeCall:
        return InvokeCall(self.schemas)

    def _step(self, final: bool) -> bool:
        if self.mode in ("start", "text"):
            if not self._text_until(START, final):
                return False
            self._marker, self.mode = START, "block"
        elif self.mode == "call":
            return self._call_step(then="block")
        else:                              # "block": another invoke, or the block's end
            body = self.buf.lstrip(_WS)
            if body.startswith(INVOKE):        # whole, so the call reads on from its tag
                self.buf = body
                self._begin_call(self._marker)
                self._marker, self.mode = "", "call"
            elif body.startswith(END):
                self.buf, self.mode = body[len(END):], "text"
            elif not final and any(tag.startswith(body) for tag in (INVOKE, END)):
                return False
            else:                          # the block breaks: the rest is content
                self._content(self._marker)
                self.mode = "plain"
        return True


class InvokeCall(XmlCall):
    """`<invoke name="NAME">` and its `<parameter name="KEY">VALUE</parameter>`s, up to
    `</invoke>`."""

    TAGS = {"start": ((INVOKE, "name"),),
            "body": (("<parameter name=", "param"), ("</invoke>", "done"))}

    def _word(self, word: str) -> str | None:
        word = word.strip()
        quoted = len(word) > 2 and word[0] == word[-1] == '"' and '"' not in word[1:-1]
        return word[1:-1] if quoted else None
