"""K-EXAONE (`ExaoneMoeForCausalLM`: LG AI Research's K-EXAONE-236B-A23B): EXAONE 4.0's attention
(per-head q/k norms; three sliding layers of four with the rotary embedding, the full ones
without) in Llama's decoder (norms before the sublayers, as OLMoE's), and in the layers
mlp_layer_types calls sparse (else those from first_k_dense_replace on) DeepSeek-V3's mixture
of experts (models/deepseek.py: the grouped sigmoid router, its correction bias kept beside
the router in the checkpoint, shared experts). The multi-token-prediction tensors (`mtp.*`)
are left out.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.deepseek import DeepseekMoeBlock, dense_layer
from conveyor.worker.models.exaone4 import Exaone4ForCausalLM
from conveyor.worker.models.llama import LlamaForCausalLM, LlamaMLP


class ExaoneMoeForCausalLM(LlamaForCausalLM):
    attention_options = staticmethod(Exaone4ForCausalLM.attention_options)
    nope_layers = staticmethod(Exaone4ForCausalLM.nope_layers)

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if dense_layer(config, layer_idx):
            return LlamaMLP(config, dtype)
        return DeepseekMoeBlock(config, dtype)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")

    def convert_weights(self, weights):
        return super().convert_weights((n, t) for n, t in weights if not n.startswith("mtp."))
