"""gpt-oss's "harmony" output (`--reasoning-parser openai_gptoss`): messages on channels.

After the prompt's `<|start|>assistant` the model writes messages, each a header, `<|message|>`,
its text and an end: `<|end|>` (another message follows, from `<|start|>assistant`), `<|return|>`
(the answer is done) or `<|call|>` (a tool call, done). The header names the channel and may name
a recipient (`to=functions.NAME`, before or after the channel) and a format (`<|constrain|>json`):

    <|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

The analysis channel is the thought (`reasoning_content`). A message to a function is a tool
call (unless the request reads no calls: tool_choice "none"; then it is content): it goes on in
the content as
`<|start|>assistant to=functions.NAME<|message|>ARGUMENTS<|call|>`, which
`--tool-call-parser openai` reads (tool_parsers/openai.py). Any other message (final, a
commentary preamble, one to a built-in tool) is content. The markers are special tokens, so a
chat request is decoded with its special tokens kept (`keeps_special_tokens`); no marker reaches
the client. An output that does not open with a header is content as it is.
"""
from __future__ import annotations

import re

from conveyor.frontend.reasoning.base import ReasoningParser
from conveyor.frontend.tool_parsers.base import partial_tail
from conveyor.frontend.tool_parsers.openai import CALL, CALL_OPEN, FUNCTIONS, MESSAGE, START

END, CHANNEL, RETURN = "<|end|>", "<|channel|>", "<|return|>"
_ENDS = (END, RETURN, CALL, START)           # a message's text ends at any of these
_HEADER_OPENS = (START, CHANNEL, "to=")
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
_WS = " \t\n\r"


class HarmonyReasoningParser(ReasoningParser):
    keeps_special_tokens = True
    writes_calls = True

    def __init__(self, calls: bool = True) -> None:
        super().__init__(calls)
        self.state = "header"                # header | text | plain
        self.channel: str | None = None
        self.recipient: str | None = None

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        thought, content = [], []
        while self.buf:
            if self.state == "plain":
                content.append(self.buf)
                self.buf = ""
            elif self.state == "header":
                if not self._read_header(final, content):
                    break
            else:
                out, ended = self._read_text(final)
                (thought if self.channel == "analysis" and not self.recipient
                 else content).append(out)
                if not ended:
                    break
                if self.recipient:
                    content.append(CALL)
                self.state, self.channel, self.recipient = "header", None, None
        return "".join(thought), "".join(content)

    def _read_header(self, final: bool, content: list[str]) -> bool:
        """Read a header up to `<|message|>`; False to wait for more text."""
        body = self.buf.lstrip(_WS)
        if final and not body:                # whitespace after the last message
            self.buf = ""
            return False
        if not body.startswith(_HEADER_OPENS):
            if final or not any(h.startswith(body) for h in _HEADER_OPENS):
                self.state = "plain"          # not harmony: the rest is content
                return True
            return False
        i = body.find(MESSAGE)
        if i < 0:
            if final:                         # the output ended in a header: nothing said
                self.buf = ""
            return False
        header, self.buf = body[:i], body[i + len(MESSAGE):]
        channel, recipient = _CHANNEL_RE.search(header), _RECIPIENT_RE.search(header)
        self.channel = channel.group(1) if channel else None
        # NOTE: a built-in tool's message (browser, python) is not a function call: content
        self.recipient = (recipient.group(1) if recipient and self.calls
                          and recipient.group(1).startswith(FUNCTIONS) else None)
        if self.recipient:
            content.append(CALL_OPEN + self.recipient + MESSAGE)
        self.state = "text"
        return True

    def _read_text(self, final: bool) -> tuple[str, bool]:
        """A message's text up to its end (consumed, but for a `<|start|>`, which opens the
        next header): (text, ended). Without an end, all but a tail that could start one."""
        found = [(i, m) for m in _ENDS if (i := self.buf.find(m)) >= 0]
        if found:
            i, marker = min(found)
            out = self.buf[:i]
            self.buf = self.buf[i if marker == START else i + len(marker):]
            return out, True
        keep = 0 if final else max(partial_tail(self.buf, m) for m in _ENDS)
        cut = len(self.buf) - keep
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    @staticmethod
    def constraint_start(tokenizer, prompt_ids: list[int], so) -> list[int] | None:
        """A structured-output constraint holds the final channel's text; a grammar that
        names harmony's markers (a tool choice's call) holds the whole output."""
        if so.grammar is not None and CHANNEL in so.grammar:
            return None
        return tokenizer.encode(CHANNEL + "final" + MESSAGE, add_special_tokens=False)
