"""Reasoning parsers (`--reasoning-parser`), one format per file: they split a model's thought
(`reasoning_content`) from its answer, as it streams (base.py)."""
from __future__ import annotations

from conveyor.frontend.reasoning.base import ReasoningParser
from conveyor.frontend.reasoning.harmony import HarmonyReasoningParser
from conveyor.frontend.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "glm45": Qwen3ReasoningParser,               # GLM-4.5/4.6 write their <think> as Qwen3 does
    "minimax_m2": DeepSeekR1ReasoningParser,     # the thought opened in the prompt, or not
    "openai_gptoss": HarmonyReasoningParser,     # gpt-oss's harmony channels
}

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "HarmonyReasoningParser",
           "Qwen3ReasoningParser", "ReasoningParser"]
