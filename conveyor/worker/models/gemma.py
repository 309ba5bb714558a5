"""Gemma (`GemmaForCausalLM`: gemma-2b/7b, gemma-1.1, CodeGemma): Llama's decoder, two norms a
layer, with Gemma 2's parts (models/gemma2.py): RMSNorms that scale by (1 + weight), a tanh-GELU
gated MLP, and the embeddings times sqrt(hidden_size) rounded to the model dtype as transformers
rounds it.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.gemma2 import GemmaMLP, GemmaRMSNorm, embedding_scale
from conveyor.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GemmaDecoderLayer(LlamaDecoderLayer):
    norm = GemmaRMSNorm


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer
    final_norm = GemmaRMSNorm

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return GemmaMLP(config, dtype)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self.model.embedding_multiplier = embedding_scale(config, dtype)
