"""Cohere Command R / R7B / A (`CohereForCausalLM`: c4ai-command-r-v01, command-r-08-2024;
`Cohere2ForCausalLM`: c4ai-command-r7b-12-2024, command-a-03-2025): Llama's projections in a
parallel block (one LayerNorm, mean-subtracted and without a bias, feeds both the attention and
the MLP, whose outputs join the residual stream together), the rotary pairs interleaved
(neighbouring features, LlamaAttention's `interleaved`), tied embeddings and the logits times
logit_scale. Command R7B and A (Cohere2) slide a window over three layers of four, which take
the rotary embedding, while the full-attention layers take none (NoPE). Command R+'s q/k
LayerNorms (use_qk_norm) are not supported.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.norm import LayerNorm
from conveyor.worker.models.exaone4 import Exaone4ForCausalLM
from conveyor.worker.models.llama import LlamaAttention, LlamaForCausalLM


class CohereDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attention_options: dict, mlp: nn.Module, residual_multiplier: float = 1.0):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype, **attention_options)
        self.mlp = mlp
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, residual, cos, sin, ctx):
        """As LlamaDecoderLayer.forward: the attention's and the MLP's outputs, both partial
        sums under tensor parallelism, leave as one (the next norm reduces it)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual, reduce=True)
        return self.self_attn(x, cos, sin, ctx) + self.mlp(x), residual


class CohereForCausalLM(LlamaForCausalLM):
    decoder_layer = CohereDecoderLayer
    final_norm = LayerNorm
    nope_layers = staticmethod(Exaone4ForCausalLM.nope_layers)   # Cohere2's full layers

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        if config.extra.get("use_qk_norm"):
            raise ValueError("Cohere checkpoints with q/k norms (use_qk_norm: Command R+) are "
                             "not supported")
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias,
                "interleaved": True}

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
        """No post-attention norm (load_format="dummy")."""
        return {"post_attention_layernorm.weight": None}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * float(self.config.extra.get("logit_scale", 1.0))
