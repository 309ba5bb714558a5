"""ERNIE 4.5 (`Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B; `Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B,
300B-A47B): Llama with the rotary pairs interleaved (neighbouring features, LlamaAttention's
`interleaved`) and, in the MoE models, from layer moe_layer_start_index on (every
moe_layer_interval-th, up to moe_layer_end_index) moe_num_experts experts, moe_k a token,
chosen by softmax scores plus a correction bias (the checkpoint's `moe_statics`) and weighted
by the unbiased scores renormalised, beside moe_num_shared_experts shared ones (models/
deepseek.py's block). Checkpoints with biases on the projections (use_bias) are refused.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.deepseek import DeepseekMoeBlock
from conveyor.worker.models.llama import LlamaForCausalLM, LlamaMLP


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        if config.extra.get("use_bias"):
            raise ValueError("ERNIE 4.5 checkpoints with biases on their projections "
                             "(use_bias) are not supported")
        return {"qkv_bias": False, "o_bias": False, "interleaved": True}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        e = config.extra
        if not e.get("moe_num_experts"):
            return LlamaMLP(config, dtype)
        start, every = e.get("moe_layer_start_index", 0), e.get("moe_layer_interval", 1)
        end = e.get("moe_layer_end_index", -1)
        end = config.num_hidden_layers - 1 if end in (None, -1) else end
        if start <= layer_idx <= end and (layer_idx + 1) % every == 0:
            return DeepseekMoeBlock(config, dtype, softmax=True, bias=True, renormalize=True)
        return LlamaMLP(config, dtype)

    def convert_weights(self, weights):
        """The correction bias [1, E] from beside the router (`mlp.moe_statics`) into it."""
        for name, tensor in weights:
            if name.endswith(".mlp.moe_statics.e_score_correction_bias"):
                yield name.replace(".moe_statics.", ".gate."), tensor.reshape(-1)
            else:
                yield name, tensor
