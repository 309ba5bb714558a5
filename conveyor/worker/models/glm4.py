"""GLM-4 (`Glm4ForCausalLM`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Llama's projections with a
bias on q, k and v, the rotary embedding over half of each head with its pairs interleaved
(neighbouring features, LlamaAttention's `interleaved`), and four norms a layer: the attention's
and the MLP's outputs are normalised (post_self_attn_layernorm, post_mlp_layernorm) before each
joins the residual stream. The checkpoint stores gate and up as one gate_up_proj. The earlier
GLM (`GlmForCausalLM`: glm-4-9b-chat-hf, glm-edge) is the same with Llama's two norms a layer.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.norm import RMSNorm
from conveyor.worker.models.glm4_moe import Glm4MoeForCausalLM
from conveyor.worker.models.llama import LlamaAttention, LlamaForCausalLM
from conveyor.worker.models.phi3 import split_fused


class Glm4DecoderLayer(nn.Module):
    output_reduced = True                    # its last norm reduces the MLP's partial sums

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attention_options: dict, mlp: nn.Module, residual_multiplier: float = 1.0):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype, **attention_options)
        self.mlp = mlp
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_self_attn_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)      # before the MLP
        self.post_mlp_layernorm = RMSNorm(h, eps, dtype)

    def forward(self, x, residual, cos, sin, ctx):
        """As LlamaDecoderLayer.forward, x in and out is still to be added to the residual; but
        it is whole under tensor parallelism: the norms right after the attention and the MLP
        reduce their partial sums."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(x, cos, sin, ctx), reduce=True)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x), reduce=True), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    decoder_layer = Glm4DecoderLayer
    rotary_embedding = staticmethod(Glm4MoeForCausalLM.rotary_embedding)   # over half a head

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": False, "interleaved": True}

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        h = config.hidden_size
        return {"post_self_attn_layernorm.weight": (h,), "post_mlp_layernorm.weight": (h,)}

    def convert_weights(self, weights):
        return split_fused(weights, self.config)


class GlmForCausalLM(Glm4ForCausalLM):
    decoder_layer = None                                    # Llama's: two norms a layer

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {}
