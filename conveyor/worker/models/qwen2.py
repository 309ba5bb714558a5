"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (never on o_proj)."""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": True, "o_bias": False}
