"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`: GLM-4.5-Air, GLM-4.5, GLM-4.6): Llama's decoder
with a bias on q, k and v (attention_bias), optional per-head q/k norms (use_qk_norm), the
rotary embedding over part of each head (partial_rotary_factor, 0.5), and after the first
first_k_dense_replace dense layers DeepSeek-V3's mixture of experts (models/deepseek.py: its
grouped sigmoid router, shared experts). The published checkpoints' multi-token-prediction
layers are left out, as transformers does.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.rotary import RotaryEmbedding
from conveyor.worker.models.deepseek import DeepseekMoeBlock, without_mtp_layers
from conveyor.worker.models.llama import LlamaForCausalLM, LlamaMLP


class Glm4MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": False,
                "qk_norm": bool(config.extra.get("use_qk_norm"))}

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        e = config.extra
        partial = (e.get("partial_rotary_factor")
                   or (e.get("rope_parameters") or {}).get("partial_rotary_factor") or 0.5)
        return RotaryEmbedding(int(config.head_dim * partial), config.max_position_embeddings,
                               config.rope_theta, config.rope_scaling)

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if layer_idx < (config.extra.get("first_k_dense_replace") or 0):
            return LlamaMLP(config, dtype)
        return DeepseekMoeBlock(config, dtype)

    def convert_weights(self, weights):
        return without_mtp_layers(weights, self.config.num_hidden_layers)
