"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`: GLM-4.5-Air, GLM-4.5, GLM-4.6): Llama's decoder
with a bias on q, k and v (attention_bias), optional per-head q/k norms (use_qk_norm), the
rotary embedding over part of each head (partial_rotary_factor, 0.5), and after the first
first_k_dense_replace dense layers a mixture of n_routed_experts experts of width
moe_intermediate_size, num_experts_per_tok a token, chosen by DeepSeek-V3's grouped sigmoid
router (layers/router.py), plus n_shared_experts shared ones every token runs (one MLP of
their summed width, unscaled).

The published checkpoints add num_nextn_predict_layers multi-token-prediction layers after the
last decoder layer (`model.layers.{num_hidden_layers}...`), which serving without them leaves
out, as transformers does.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import FusedMoE
from conveyor.worker.layers.rotary import RotaryEmbedding
from conveyor.worker.layers.router import GroupedTopKRouter
from conveyor.worker.models.llama import LlamaForCausalLM, LlamaMLP

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Glm4MoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        e = config.extra
        experts = e.get("n_routed_experts") or e["num_local_experts"]
        renormalize = bool(e.get("norm_topk_prob", True))
        self.gate = GroupedTopKRouter(experts, config.hidden_size, e["num_experts_per_tok"],
                                      e.get("n_group") or 1, e.get("topk_group") or 1,
                                      renormalize, float(e.get("routed_scaling_factor") or 1.0))
        self.experts = FusedMoE(experts, e["num_experts_per_tok"], config.hidden_size,
                                e["moe_intermediate_size"], renormalize, dtype)
        shared = e.get("n_shared_experts") or 0
        self.shared_experts = (LlamaMLP(config, dtype, e["moe_intermediate_size"] * shared)
                               if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial sums [T, H]."""
        out = self.experts.mix(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


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
        return Glm4MoeBlock(config, dtype)

    def convert_weights(self, weights):
        """The checkpoint's tensors less its multi-token-prediction layers."""
        layers = self.config.num_hidden_layers
        for name, tensor in weights:
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < layers:
                yield name, tensor
