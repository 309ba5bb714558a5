"""Granite 3.x (dense): Llama with four scalars from config.json, where transformers puts them:
the embeddings times embedding_multiplier, every attention and MLP output times
residual_multiplier before it joins the residual stream, attention_multiplier as the softmax
scale (in place of head_dim^-0.5), and the logits divided by logits_scaling.
"""
from __future__ import annotations

import torch

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {**LlamaForCausalLM.attention_options(config),
                "scale": float(config.extra.get("attention_multiplier", 1.0))}

    @staticmethod
    def multipliers(config: ModelConfig) -> tuple[float, float]:
        e = config.extra
        return float(e.get("embedding_multiplier", 1.0)), float(e.get("residual_multiplier", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / float(self.config.extra.get("logits_scaling", 1.0))
