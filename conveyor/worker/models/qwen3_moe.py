"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in place of the MLP a
mixture of `num_experts` experts of width moe_intermediate_size, `num_experts_per_tok` of them a
token, their router weights renormalised to sum to 1 when norm_topk_prob. Layers listed in
mlp_only_layers, or off the decoder_sparse_step rhythm, keep a dense MLP of intermediate_size.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import SparseMoeBlock
from conveyor.worker.models.llama import LlamaMLP
from conveyor.worker.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        e = config.extra
        experts = e.get("num_experts") or e.get("num_local_experts") or 0   # hub, or v5
        sparse = (experts > 0 and layer_idx not in (e.get("mlp_only_layers") or ())
                  and (layer_idx + 1) % (e.get("decoder_sparse_step") or 1) == 0)
        if not sparse:
            return LlamaMLP(config, dtype)
        return SparseMoeBlock(experts, e["num_experts_per_tok"], config.hidden_size,
                              e["moe_intermediate_size"], bool(e.get("norm_topk_prob")), dtype)
