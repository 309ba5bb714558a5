"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in place of the MLP a
mixture of `num_experts` experts of width moe_intermediate_size, `num_experts_per_tok` of them a
token, their router weights renormalised to sum to 1 when norm_topk_prob. Layers listed in
mlp_only_layers, or off the decoder_sparse_step rhythm, keep a dense MLP of intermediate_size.

Qwen3-VL-MoE's language model (Qwen3-VL-30B-A3B, served for its text) is this model with each
layer's experts stacked: `mlp.experts.gate_up_proj` (gate's rows, then up's) and `down_proj`,
[E, inputs, outputs] as published, [E, outputs, inputs] as transformers >= 5 saves them.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import SparseMoeBlock, per_expert
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

    def convert_weights(self, weights):
        """Stacked experts split per expert (in either orientation); the rest as it is."""
        e = self.config.extra
        inter, hidden = e.get("moe_intermediate_size"), self.config.hidden_size
        for name, tensor in weights:
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                rows = 2 * inter if name.endswith("gate_up_proj") else hidden
                # NOTE: a square shape is taken as [E, outputs, inputs], as transformers does
                if tensor.shape[1] != rows:
                    tensor = tensor.transpose(1, 2)
                yield from per_expert(name, tensor)
            else:
                yield name, tensor
