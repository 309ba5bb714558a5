"""Tool-call parsers, by the name `--tool-call-parser` takes (one model family per file)."""
from __future__ import annotations

from conveyor.frontend.tool_parsers.base import Delta, Parsed, ToolCall, ToolParser
from conveyor.frontend.tool_parsers.glm45 import Glm45Parser
from conveyor.frontend.tool_parsers.hermes import HermesParser
from conveyor.frontend.tool_parsers.json_array import JsonArrayParser
from conveyor.frontend.tool_parsers.llama3_json import Llama3JsonParser
from conveyor.frontend.tool_parsers.minimax_m2 import MiniMaxM2Parser
from conveyor.frontend.tool_parsers.mistral import MistralParser
from conveyor.frontend.tool_parsers.named import NamedCallParser
from conveyor.frontend.tool_parsers.openai import OpenAIParser
from conveyor.frontend.tool_parsers.pythonic import PythonicParser
from conveyor.frontend.tool_parsers.qwen3_coder import Qwen3CoderParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "glm45": Glm45Parser,                    # GLM-4.5, 4.6
    "glm47": Glm45Parser,                    # GLM-4.7: the first key may follow the name
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "minimax_m2": MiniMaxM2Parser,
    "mistral": MistralParser,
    "openai": OpenAIParser,                  # gpt-oss (with --reasoning-parser openai_gptoss)
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}

__all__ = ["TOOL_PARSERS", "Delta", "Glm45Parser", "HermesParser", "JsonArrayParser",
           "Llama3JsonParser", "MiniMaxM2Parser", "MistralParser", "NamedCallParser",
           "OpenAIParser", "Parsed", "PythonicParser", "Qwen3CoderParser", "ToolCall",
           "ToolParser"]
