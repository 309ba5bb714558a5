"""What every tool-call parser shares: the stream it writes and the whole-output parse.

A parser reads a model's output as it streams (`feed`, then `finish`) and writes a `Delta`:
ordinary content, and OpenAI `tool_calls` deltas (the first of a call carries its index, id, type
and name; the next ones add to its arguments). A family's file says only where calls sit in the
text (its tags or layout); each call's JSON is read by `CallObject`. The whole-output parse runs
the same machine over the whole text, so a stream and a whole response always agree on a
well-formed output.

Rules common to all families: whitespace that touches a call is not content; a call whose JSON
breaks before its name is complete falls back to content, and so does the rest of the output; a
call that breaks after its name has gone out in a stream is cut there (the whole-output parse
then returns the whole text as content, since it can still take the call back).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from conveyor.frontend.tool_parsers.call_object import CallObject

_WS = " \t\n\r"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str                         # JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)    # OpenAI tool_calls delta entries

    def add(self, other: Delta) -> Delta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


@dataclass
class Parsed:
    content: str
    tool_calls: list[ToolCall]


class ToolParser:
    """Subclasses implement `_step`: consume what they can of `self.buf`, False to wait."""
    arg_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, tools: tuple[dict, ...] = ()) -> None:
        self.tools = tools                 # the request's functions; most families ignore them
        self.buf = ""
        self.mode = "start"
        self.broken = False                # a call broke after its name went out
        self.num_calls = 0
        self._out = Delta()
        self._ws = ""                      # trailing content whitespace, held back
        self._held_ws = ""                 # the whitespace before the call being read
        self._after_call = False           # drop the whitespace that follows a call
        self._obj: CallObject | None = None
        self._raw = ""                     # the current call's text, from its marker
        self._sent = -1                    # arguments characters sent; -1: name not sent yet

    # --- the interface ------------------------------------------------------------------------

    def feed(self, text: str) -> Delta:
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> Delta:
        self._run(final=True)
        if self._obj is not None:          # the output ended inside a call
            self._end_call(truncated=True)
        self._content(self.buf)
        self.buf = ""
        if not self._after_call:
            self._out.content += self._ws
        self._ws = ""
        return self._take()

    @classmethod
    def parse(cls, text: str, *args) -> Parsed:
        """The whole output of a fresh parser (`args` are its constructor's)."""
        return cls(*args).parse_all(text)

    def parse_all(self, text: str) -> Parsed:
        """The whole output: its content and calls (all content if a call broke)."""
        delta = self.feed(text).add(self.finish())
        calls: list[ToolCall] = []
        for d in delta.tool_calls:
            if "id" in d:
                calls.append(ToolCall(d["function"]["name"], "", d["id"]))
            calls[-1].arguments += d["function"]["arguments"]
        if self.broken:
            return Parsed(text, [])
        return Parsed(delta.content, calls)

    # --- for the families ---------------------------------------------------------------------

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _run(self, final: bool) -> None:
        while self.buf:
            if self.mode == "plain":
                self._content(self.buf)
                self.buf = ""
            elif not self._step(final):
                return

    def _content(self, s: str) -> None:
        if self._after_call:
            s = s.lstrip(_WS)
            if not s:
                return
            self._after_call = False
        body = s.rstrip(_WS)
        if body:
            self._out.content += self._ws + body
            self._ws = s[len(body):]
        else:
            self._ws += s

    def _text_until(self, marker: str, final: bool) -> bool:
        """Content up to `marker`, which is consumed: True if found. Otherwise the buffer goes
        out as content but for a tail that could be the start of the marker."""
        i = self.buf.find(marker)
        if i >= 0:
            self._content(self.buf[:i])
            self.buf = self.buf[i + len(marker):]
            return True
        keep = 0 if final else partial_tail(self.buf, marker)
        self._content(self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _new_call(self) -> CallObject:
        """The reader of one call; a family whose calls are not JSON objects gives its own, with
        CallObject's interface (`feed`, `state`, `name`, `name_checked`, the arguments)."""
        return CallObject(self.arg_keys)

    def _begin_call(self, marker: str = "") -> None:
        self._held_ws, self._ws = self._ws, ""
        self._obj = self._new_call()
        self._raw, self._sent = marker, -1

    def _call_step(self, then: str) -> bool:
        """Read the current call; once it is done, go on in mode `then`. False to wait."""
        state = self._read_call()
        if state == "more":
            return False
        if state == "done" and self.mode == "call":
            self.mode = then
        return True

    def _next_call(self, separator: str, end: str = "", then: str = "plain") -> bool:
        """After a call: `separator` starts another, `end` closes the list (mode `then`), and
        anything else is content. False to wait."""
        body = self.buf.lstrip(_WS)
        if not body:
            return False
        if body.startswith(separator):
            self.buf = body[len(separator):]
            self._begin_call(separator)
            self.mode = "call"
        elif end and body.startswith(end):
            self.buf, self.mode = body[len(end):], then
        else:
            self.mode = "plain"
        return True

    def _read_call(self) -> str:
        """Feed the buffer to the call being read: "done", "more" (wait) or "fallback"."""
        obj = self._obj
        if obj.state == "start":
            body = self.buf.lstrip(_WS)
            self._raw += self.buf[:len(self.buf) - len(body)]
            self.buf = body
            if not body:
                return "more"
        n = obj.feed(self.buf)
        self._raw += self.buf[:n]
        self.buf = self.buf[n:]
        if self._sent < 0 and obj.name is not None and not obj.error and obj.name_checked():
            self._send_name()
        if self._sent >= 0:
            self._send_arguments()
        if obj.error or (obj.done and not obj.valid):
            if self._sent < 0:
                self._fallback()
                return "fallback"
            self._end_call(truncated=True)
            return "done"
        if obj.done:
            self._end_call(truncated=False)
            return "done"
        return "more"

    def _fallback(self) -> None:
        """The call was not one: its text, and the rest of the output, are content."""
        self._ws, self._obj = self._held_ws, None
        self._content(self._raw + self.buf)
        self.buf, self.mode = "", "plain"

    # --- internals ----------------------------------------------------------------------------

    def _send_name(self) -> None:
        self._sent = 0
        self._out.tool_calls.append({"index": self.num_calls, "id": new_call_id(),
                                     "type": "function",
                                     "function": {"name": self._obj.name, "arguments": ""}})

    def _send_arguments(self, final: bool = False) -> None:
        text = self._obj.arguments() if final else self._obj.arguments_so_far()
        if len(text) > self._sent:
            self._out.tool_calls.append({"index": self.num_calls,
                                         "function": {"arguments": text[self._sent:]}})
            self._sent = len(text)

    def _end_call(self, truncated: bool) -> None:
        if self._sent < 0:                 # never named: not a call
            self._fallback()
            return
        if truncated:
            self.broken = True
            self.mode = "plain"
        else:
            self._send_arguments(final=True)
        self.num_calls += 1
        self._obj, self._after_call = None, True

    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out


def partial_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
