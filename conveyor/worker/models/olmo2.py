"""OLMo 2 and OLMo 3 (`Olmo2ForCausalLM`, `Olmo3ForCausalLM`, AllenAI's fully open models):
Llama's projections with the norms moved after the sublayers: a layer's attention and MLP read
the residual stream itself, and their outputs are normalised (post_attention_layernorm,
post_feedforward_layernorm) before they join it; q and k are each normalised over all their
heads before the rotary embedding (layers/norm.py's ShardedRMSNorm under tensor parallelism).
OLMo 3 slides a window over three layers of four (`layer_types`, config.layer_windows), whose
rotary embedding is not scaled where the full layers' is (YaRN in its long-context models).
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.norm import RMSNorm
from conveyor.worker.layers.rotary import RotaryEmbedding, layer_type_ropes
from conveyor.worker.models.llama import LlamaAttention, LlamaForCausalLM


class OlmoDecoderLayer(nn.Module):
    output_reduced = True                    # its last norm reduces the MLP's partial sums

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attention_options: dict, mlp: nn.Module, residual_multiplier: float = 1.0):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype, **attention_options)
        self.mlp = mlp
        h, eps = config.hidden_size, config.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype)

    def forward(self, x, residual, cos, sin, ctx):
        """As LlamaDecoderLayer.forward: x in and out is still to be added to the residual
        stream (whole: the norm after each sublayer reduces its partial sums)."""
        stream = x if residual is None else x + residual
        x = self.post_attention_layernorm(self.self_attn(stream, cos, sin, ctx), reduce=True)
        stream = stream + x
        return self.post_feedforward_layernorm(self.mlp(stream), reduce=True), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = OlmoDecoderLayer

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias,
                "qk_norm": "all"}

    @staticmethod
    def rotary_embedding(config: ModelConfig):
        """OLMo 3: the full layers' (with the config's scaling, YaRN in the long-context
        models) and the sliding layers' own (the same base, unscaled)."""
        if not config.layer_windows:
            return LlamaForCausalLM.rotary_embedding(config)
        full, local = layer_type_ropes(config.extra, config.rope_theta, config.rope_theta)
        d, n = config.head_dim, config.max_position_embeddings
        return RotaryEmbedding(d, n, *full), RotaryEmbedding(d, n, *local)

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
        """A layer's checkpoint tensors beyond Llama's, or in place of them (None: not there),
        for load_format="dummy": no input_layernorm."""
        return {"input_layernorm.weight": None,
                "post_feedforward_layernorm.weight": (config.hidden_size,)}
