"""`<think>…</think>` reasoning (`--reasoning-parser qwen3|deepseek_r1`).

qwen3: the output opens its thought with `<think>`; an output without it has no thought (the
template turned thinking off with `enable_thinking: false`, and wrote an empty thought into the
prompt). deepseek_r1: the template opens the thought in the prompt, so the output starts inside
it, with or without its own `<think>`; an output that never closes it is all thought. The answer's
leading whitespace after `</think>` is dropped. A structured-output constraint starts after
`</think>` (qwen3: or at the first token, for an output that does not begin with `<think>`).
"""
from __future__ import annotations

from conveyor.frontend.reasoning.base import ReasoningParser
from conveyor.frontend.tool_parsers.base import partial_tail

START, END = "<think>", "</think>"
_WS = " \t\n\r"


class ThinkParser(ReasoningParser):
    opened_in_prompt = False

    def __init__(self, calls: bool = True) -> None:
        super().__init__(calls)
        self.state = "start"                  # start | reasoning | answer_start | answer

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            body = self.buf.lstrip(_WS)
            if body.startswith(START):
                self.buf, self.state = body[len(START):], "reasoning"
            elif not final and START.startswith(body):
                return "", ""                 # perhaps "<think>" still to come
            else:
                self.state = "reasoning" if self.opened_in_prompt else "answer"
        if self.state == "reasoning":
            i = self.buf.find(END)
            if i < 0:
                keep = 0 if final else partial_tail(self.buf, END)
                cut = len(self.buf) - keep
                reasoning, self.buf = self.buf[:cut], self.buf[cut:]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:i], self.buf[i + len(END):], "answer_start"
        if self.state == "answer_start":
            self.buf = self.buf.lstrip(_WS)
            if self.buf:
                self.state = "answer"
        if self.state == "answer":
            content, self.buf = self.buf, ""
        return reasoning, content

    @staticmethod
    def constraint_start(tokenizer, prompt_ids: list[int], so) -> list[int] | None:
        """The token ids after which a structured-output constraint starts: those of `</think>`,
        unless the prompt already closed the thought (thinking turned off): then None."""
        tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False).rstrip(_WS)
        if tail.endswith(END):
            return None
        return tokenizer.encode(END, add_special_tokens=False)

    @classmethod
    def thought_open(cls, tokenizer) -> list[int] | None:
        """qwen3's thought is `<think>` first in the output; an output without it has none,
        and the constraint holds it all (a model that does not think stays held)."""
        return None if cls.opened_in_prompt else tokenizer.encode(START, add_special_tokens=False)


class Qwen3ReasoningParser(ThinkParser):
    opened_in_prompt = False


class DeepSeekR1ReasoningParser(ThinkParser):
    opened_in_prompt = True
