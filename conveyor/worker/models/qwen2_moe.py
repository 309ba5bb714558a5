"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (a bias on q, k and v), and
in place of the MLP a mixture of `num_experts` experts of width moe_intermediate_size,
`num_experts_per_tok` of them a token (router weights renormalised only when norm_topk_prob),
plus a shared expert of width shared_expert_intermediate_size that every token runs, scaled by
sigmoid(shared_expert_gate(x)). Layers listed in mlp_only_layers, or off the decoder_sparse_step
rhythm, keep a dense MLP of intermediate_size.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import SparseMoeBlock
from conveyor.worker.models.llama import LlamaForCausalLM, LlamaMLP


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": bool(config.extra.get("qkv_bias", True)), "o_bias": False}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        e = config.extra
        experts = e.get("num_experts") or 0
        sparse = (experts > 0 and layer_idx not in (e.get("mlp_only_layers") or ())
                  and (layer_idx + 1) % (e.get("decoder_sparse_step") or 1) == 0)
        if not sparse:
            return LlamaMLP(config, dtype)
        shared = LlamaMLP(config, dtype, e["shared_expert_intermediate_size"])
        return SparseMoeBlock(experts, e["num_experts_per_tok"], config.hidden_size,
                              e["moe_intermediate_size"], bool(e.get("norm_topk_prob")), dtype,
                              shared_expert=shared)
