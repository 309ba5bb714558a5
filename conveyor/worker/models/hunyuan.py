"""Hunyuan dense (`HunYuanDenseV1ForCausalLM`: Hunyuan-0.5B/1.8B/4B/7B-Instruct): Llama with
per-head q/k RMSNorms applied after the rotary embedding (the checkpoint's query_layernorm and
key_layernorm), biases on the attention projections where attention_bias says, and the rotary
embedding's NTK "alpha" scaling (rope type "dynamic" with an alpha, which transformers reads
as a fixed stretch of the base: theta * alpha^(d / (d - 2))). MLP biases are refused.
"""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.rotary import RotaryEmbedding
from conveyor.worker.models.llama import LlamaForCausalLM, renamer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    checkpoint_name = renamer({".self_attn.query_layernorm.": ".self_attn.q_norm.",
                               ".self_attn.key_layernorm.": ".self_attn.k_norm."})

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        if config.extra.get("mlp_bias"):
            raise ValueError("Hunyuan checkpoints with MLP biases (mlp_bias) are not supported")
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias,
                "qk_norm": True, "norm_after_rotary": True}

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        d, scaling = config.head_dim, dict(config.rope_scaling or {})
        alpha = scaling.pop("alpha", None)
        base = config.rope_theta
        if alpha:
            base *= float(alpha) ** (d / (d - 2))
            scaling = {}                    # "dynamic" with an alpha: only the base stretches
        return RotaryEmbedding(d, config.max_position_embeddings, base, scaling or None)
