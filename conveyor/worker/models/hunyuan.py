"""Hunyuan dense (`HunYuanDenseV1ForCausalLM`: Hunyuan-0.5B/1.8B/4B/7B-Instruct): Llama with
per-head q/k RMSNorms applied after the rotary embedding (the checkpoint's query_layernorm and
key_layernorm), biases on the attention projections where attention_bias says, and the rotary
embedding's NTK "alpha" scaling (rope type "dynamic" with an alpha, which transformers reads
as a fixed stretch of the base: theta * alpha^(d / (d - 2))). MLP biases are refused.

Hunyuan MoE (`HunYuanMoEV1ForCausalLM`: Hunyuan-A13B-Instruct) adds, in place of every MLP,
num_experts experts chosen by a float32 softmax router (`mlp.gate.wg`), moe_topk a token and
their weights renormalised when more than one, beside num_shared_expert shared experts run as
one ungated MLP of intermediate_size times their count (`mlp.shared_mlp`). The published
config gives moe_topk, moe_intermediate_size and num_shared_expert per layer (lists, or one
value for all); transformers' port reads intermediate_size for the experts and always
renormalises (the same for A13B, whose layers take 8 experts of intermediate_size). Its
cross-layer attention (use_cla) is refused.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import FusedMoE
from conveyor.worker.layers.rotary import RotaryEmbedding
from conveyor.worker.layers.router import GroupedTopKRouter
from conveyor.worker.models.deepseek import DeepseekMoeBlock
from conveyor.worker.models.llama import LlamaForCausalLM, LlamaMLP, renamer

# the checkpoint's q/k norms under Qwen3's names
_QK_NORMS = {".self_attn.query_layernorm.": ".self_attn.q_norm.",
             ".self_attn.key_layernorm.": ".self_attn.k_norm."}


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    checkpoint_name = renamer(_QK_NORMS)

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        if config.extra.get("mlp_bias"):
            raise ValueError("Hunyuan checkpoints with MLP biases (mlp_bias) are not supported")
        if config.extra.get("use_cla"):
            raise ValueError("Hunyuan checkpoints with cross-layer attention (use_cla) are not "
                             "supported")
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


def _of_layer(value, layer_idx: int):
    """A config value given once for all layers or as a per-layer list."""
    return value[layer_idx] if isinstance(value, list) else value


class HunYuanMoeBlock(DeepseekMoeBlock):
    """The router (`gate`, the checkpoint's gate.wg), the experts and the shared MLP
    (`shared_experts`, the checkpoint's shared_mlp): DeepseekMoeBlock's forward."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        e = config.extra
        experts = _of_layer(e["num_experts"], layer_idx)
        top_k = _of_layer(e.get("moe_topk", 1), layer_idx)
        width = _of_layer(e.get("moe_intermediate_size") or config.intermediate_size, layer_idx)
        self.gate = GroupedTopKRouter(experts, config.hidden_size, top_k, 1, 1, top_k > 1, 1.0,
                                      softmax=True)
        self.experts = FusedMoE(experts, top_k, config.hidden_size, width, top_k > 1, dtype)
        shared = _of_layer(e.get("num_shared_expert", 1), layer_idx)
        if not e.get("use_mixed_mlp_moe", True):
            shared = 0
        self.shared_experts = (LlamaMLP(config, dtype, config.intermediate_size * shared)
                               if shared else None)


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    checkpoint_name = renamer({**_QK_NORMS, ".mlp.gate.wg.": ".mlp.gate.",
                               ".mlp.shared_mlp.": ".mlp.shared_experts."})

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if _of_layer(config.extra.get("num_experts") or 1, layer_idx) <= 1:
            return LlamaMLP(config, dtype)
        return HunYuanMoeBlock(config, layer_idx, dtype)
