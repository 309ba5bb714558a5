"""One chat choice's output as the API returns it: thought, content and tool calls.

The reasoning parser (if the server has one) splits the thought off first; what remains goes to
the request's tool-call parser (if its tool_choice reads calls). A stream gets `delta` per piece
of text, a whole response `message` once; both run the same parsers, so they agree.
"""
from __future__ import annotations

from conveyor.frontend.reasoning import ReasoningParser
from conveyor.frontend.tools import ToolMode


class ChatReader:
    def __init__(self, reasoning: type[ReasoningParser] | None, tools: ToolMode | None,
                 include_reasoning: bool = True):
        self.tools = tools.new_parser() if tools is not None else None
        self.reasoning = reasoning(self.tools is not None) if reasoning is not None else None
        self.include_reasoning = include_reasoning   # False: the thought is split off, unsent
        self.parallel = tools is None or tools.parallel
        self.called = False                  # a tool call went out

    def delta(self, text: str, final: bool) -> dict:
        """The OpenAI `delta` for the next piece of text (only the fields with news)."""
        thought, content = "", text
        if self.reasoning is not None:
            thought, content = self.reasoning.feed(text)
            if final:
                more = self.reasoning.finish()
                thought, content = thought + more[0], content + more[1]
        out = {}
        if thought and self.include_reasoning:
            out["reasoning_content"] = thought
        if self.tools is not None:
            d = self.tools.feed(content)
            if final:
                d.add(self.tools.finish())
            content = d.content
            calls = [c for c in d.tool_calls if self.parallel or c["index"] == 0]
            if calls:
                self.called = True
                out["tool_calls"] = calls
        if content:
            out["content"] = content
        return out

    def message(self, text: str) -> dict:
        """The OpenAI `message` of the whole output."""
        thought, content = None, text
        if self.reasoning is not None:
            thought, content = type(self.reasoning).parse(text, self.reasoning.calls)
        calls = []
        if self.tools is not None:
            parsed = self.tools.parse_all(content)
            content = parsed.content
            calls = [c.to_openai() for c in parsed.tool_calls[:None if self.parallel else 1]]
        self.called = bool(calls)
        out = {"role": "assistant",
               "content": content or (None if calls or thought else content)}
        if calls:
            out["tool_calls"] = calls
        if self.reasoning is not None and self.include_reasoning:
            out["reasoning_content"] = thought or None
        return out
