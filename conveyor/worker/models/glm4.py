"""GLM (`GlmForCausalLM`: glm-4-9b-chat-hf, glm-edge) and GLM-4 (`Glm4ForCausalLM`:
GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Llama's projections with a bias on q, k and v, the rotary
embedding over half of each head with its pairs interleaved (neighbouring features,
LlamaAttention's `interleaved`), gate and up stored as one gate_up_proj. GLM-4 has four norms a
layer: the attention's and the MLP's outputs are normalised (post_self_attn_layernorm,
post_mlp_layernorm) before each joins the residual stream, which is Gemma 2's layer with plain
RMSNorms, its norms renamed at load.
"""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.norm import RMSNorm
from conveyor.worker.models.gemma2 import Gemma2DecoderLayer
from conveyor.worker.models.glm4_moe import Glm4MoeForCausalLM
from conveyor.worker.models.llama import LlamaForCausalLM, renamer
from conveyor.worker.models.phi3 import split_fused


class Glm4DecoderLayer(Gemma2DecoderLayer):
    norm = RMSNorm


class GlmForCausalLM(LlamaForCausalLM):
    rotary_embedding = staticmethod(Glm4MoeForCausalLM.rotary_embedding)   # over half a head

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": False, "interleaved": True}

    def convert_weights(self, weights):
        return super().convert_weights(split_fused(weights, self.config))


class Glm4ForCausalLM(GlmForCausalLM):
    decoder_layer = Glm4DecoderLayer
    # GLM-4's norms under Gemma 2's names: after the attention, before the MLP, after it
    checkpoint_name = renamer({".post_self_attn_layernorm.": ".post_attention_layernorm.",
                               ".post_attention_layernorm.": ".pre_feedforward_layernorm.",
                               ".post_mlp_layernorm.": ".post_feedforward_layernorm."})

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        h = config.hidden_size
        return {"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}
