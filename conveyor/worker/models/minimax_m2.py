"""MiniMax-M2 (`MiniMaxM2ForCausalLM`: MiniMax-M2, M2.1): Llama's attention with q and k each
normalised over all their heads (OLMo's, models/olmo2.py) and the rotary embedding over the
first rotary_dim features of each head; in every layer a mixture of num_local_experts experts
of width intermediate_size under DeepSeek-V3's sigmoid router with its correction bias, in one
group and without shared experts (models/deepseek.py's block). The checkpoint names the block
`block_sparse_moe` with Mixtral's expert names and keeps the correction bias beside the router;
layers past num_hidden_layers (multi-token prediction) are left out.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.rotary import RotaryEmbedding
from conveyor.worker.models.deepseek import DeepseekMoeBlock, without_mtp_layers
from conveyor.worker.models.llama import LlamaForCausalLM
from conveyor.worker.models.mixtral import MixtralForCausalLM


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": "all"}

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        e, d = config.extra, config.head_dim
        partial = (e.get("partial_rotary_factor")
                   or (e.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0)
        return RotaryEmbedding(e.get("rotary_dim") or int(d * partial),
                               config.max_position_embeddings, config.rope_theta,
                               config.rope_scaling)

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return DeepseekMoeBlock(config, dtype)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name as DeepSeek's block loads it (its scales' too)."""
        name = MixtralForCausalLM.checkpoint_name(name)
        return name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")

    def convert_weights(self, weights):
        return super().convert_weights(
            without_mtp_layers(weights, self.config.num_hidden_layers))
