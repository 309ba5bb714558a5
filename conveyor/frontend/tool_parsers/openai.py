"""gpt-oss's calls (`--tool-call-parser openai`), as the harmony reasoning parser hands them on in
the content (frontend/reasoning/harmony.py), so it needs `--reasoning-parser openai_gptoss`:

    Let me look.<|start|>assistant to=functions.get_weather<|message|>{"city": "Paris"}<|call|>

The recipient `functions.NAME` names the call and the message is its arguments, a JSON object,
streamed as the model writes it. A recipient that is not a function (a built-in tool) is content.

`call_grammar` is what holds a harmony output to a call under tool_choice "required" or a named
function: a thought (optional), then the call in the header gpt-oss writes, its arguments held
to the function's schema.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

from conveyor.frontend.tool_parsers.base import ToolParser, partial_tail
from conveyor.frontend.tool_parsers.call_object import CallReader
from conveyor.shared.grammar import JSON_OPTIONS

# harmony's markers (special tokens), and a call as reasoning/harmony.py hands it on
START, MESSAGE, CALL = "<|start|>", "<|message|>", "<|call|>"
CALL_OPEN = START + "assistant to="
FUNCTIONS = "functions."
_ANY_OBJECT = {"type": "object"}


def call_grammar(functions: Sequence[dict]) -> str:
    """A Lark grammar (llguidance's, where `<|name|>` is that special token) for a harmony
    output that is one call of one of `functions` ({"name", "parameters"}), perhaps after an
    analysis message. Calls end at `<|call|>`: harmony has one call a turn. The arguments are
    compact JSON, as every JSON constraint here (shared/grammar.py)."""
    def schema(f: dict) -> str:
        return json.dumps({**(f.get("parameters") or _ANY_OBJECT), "x-guidance": JSON_OPTIONS})

    calls = [f'<|channel|> {json.dumps("commentary to=" + FUNCTIONS + f["name"] + " ")} '
             f'<|constrain|> "json" <|message|> %json {schema(f)} <|call|>' for f in functions]
    return "\n".join([
        "start: analysis? call",
        'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
        "THOUGHT: /(?s:.*)/",                # text: a special token ends it
        "call: " + "\n    | ".join(calls)])


class OpenAIParser(ToolParser):
    def _new_call(self) -> HarmonyCall:
        return HarmonyCall()

    def _step(self, final: bool) -> bool:
        if self.mode in ("start", "text"):
            if not self._text_until(CALL_OPEN, final):
                return False
            self._begin_call(CALL_OPEN)
            self.mode = "call"
            return True
        return self._call_step(then="text")


class HarmonyCall(CallReader):
    """`functions.NAME<|message|>ARGUMENTS<|call|>`, with CallObject's interface: name at
    `<|message|>`, the arguments' text as it comes (less a tail that could start `<|call|>`)."""

    def __init__(self) -> None:
        self.text = ""
        self.state = "start"                  # start (the recipient) | body | done | error
        self.name: str | None = None
        self.valid = False
        self._body = 0                        # where the arguments begin in text

    def name_checked(self) -> bool:
        return self.name is not None

    def feed(self, s: str) -> int:
        at = len(self.text)
        self.text += s
        if self.state == "start":
            i = self.text.find(MESSAGE)
            if i < 0:
                return len(s)
            recipient = self.text[:i].strip()
            if not recipient.startswith(FUNCTIONS) or len(recipient) == len(FUNCTIONS):
                self.state = "error"
                return len(s)
            self.name, self.state, self._body = recipient[len(FUNCTIONS):], "body", i + len(MESSAGE)
        end = self.text.find(CALL, self._body)
        if end < 0:
            return len(s)
        self.state, self.text = "done", self.text[:end + len(CALL)]
        try:
            self.valid = isinstance(json.loads(self.arguments()), dict)
        except ValueError:
            self.valid = False
        return len(self.text) - at

    def arguments_so_far(self) -> str:
        body = self.text[self._body:] if self.state == "body" else ""
        return body[:len(body) - partial_tail(body, CALL)].strip()

    def arguments(self) -> str:
        body = self.text[self._body:]
        return body.removesuffix(CALL).strip()
