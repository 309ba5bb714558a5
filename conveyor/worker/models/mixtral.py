"""Mixtral: Mistral's attention (sliding window where the config sets one) and in every layer
a mixture of num_local_experts experts of width intermediate_size, num_experts_per_tok a token,
their router weights always renormalised. The checkpoint's `block_sparse_moe` with experts'
w1 / w3 / w2 is loaded as Qwen3-MoE's `mlp` with gate_proj / up_proj / down_proj.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import SparseMoeBlock
from conveyor.worker.models.llama import LlamaForCausalLM

_EXPERT_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        e = config.extra
        return SparseMoeBlock(e["num_local_experts"], e["num_experts_per_tok"],
                              config.hidden_size, config.intermediate_size, True, dtype)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name as Qwen3-MoE's (its scales' and 4-bit parts' too)."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." in name:
            for old, new in _EXPERT_NAMES.items():
                name = name.replace(old, new)
        return name
