"""dots.llm1 (`Dots1ForCausalLM`: rednote's dots.llm1.base / .inst): Qwen3's attention (per-head
q/k norms) and after the first first_k_dense_replace dense layers DeepSeek-V3's mixture of
experts (its grouped sigmoid router with the correction bias, shared experts): GLM-4.5's
layers (models/glm4_moe.py) with a rotary embedding over every feature of a head.
"""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.rotary import RotaryEmbedding
from conveyor.worker.models.glm4_moe import Glm4MoeForCausalLM
from conveyor.worker.models.llama import LlamaForCausalLM


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": False, "qk_norm": True}

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        return LlamaForCausalLM.rotary_embedding(config)
