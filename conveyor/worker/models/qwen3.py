"""Qwen3 (dense): Llama with an RMSNorm over each head of q and k before the rotary embedding,
and no q/k/v bias unless the config asks for one.
"""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias,
                "qk_norm": True}
