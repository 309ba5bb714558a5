"""OLMoE and FlexOlmo (`OlmoeForCausalLM`: OLMoE-1B-7B; `FlexOlmoForCausalLM`: FlexOlmo-7x7B):
AllenAI's mixtures of experts, num_experts experts of width intermediate_size a layer,
num_experts_per_tok a token by a softmax router (renormalised where norm_topk_prob says), with
q and k each normalised over all their heads. OLMoE keeps Llama's norms before the sublayers;
FlexOlmo moves them after, as OLMo 2 does (models/olmo2.py). OLMoE's clip_qkv is refused.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import SparseMoeBlock
from conveyor.worker.models.llama import LlamaForCausalLM
from conveyor.worker.models.olmo2 import Olmo2ForCausalLM


def _moe(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    e = config.extra
    return SparseMoeBlock(e["num_experts"], e["num_experts_per_tok"], config.hidden_size,
                          config.intermediate_size, bool(e.get("norm_topk_prob")), dtype)


class OlmoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        if config.extra.get("clip_qkv") is not None:
            raise ValueError("OLMoE checkpoints that clip q, k and v (clip_qkv) are not "
                             "supported")
        return {"qkv_bias": False, "o_bias": False, "qk_norm": "all"}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return _moe(config, dtype)


class FlexOlmoForCausalLM(Olmo2ForCausalLM):
    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return _moe(config, dtype)
