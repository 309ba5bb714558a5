"""Phi-3 / Phi-4 (dense): Llama whose checkpoint stores q, k and v as one qkv_proj and gate and
up as one gate_up_proj (split here into the parts our fused layers load, so tensor parallelism
slices each as usual), with LongRoPE ("longrope", or "su") scaling and, in Phi-4-mini, a rotary
embedding over part of each head (partial_rotary_factor).
"""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.rotary import RotaryEmbedding
from conveyor.worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        e = config.extra
        scaling = dict(config.rope_scaling or {})
        partial = scaling.get("partial_rotary_factor") or e.get("partial_rotary_factor") or 1.0
        if scaling:
            scaling.setdefault("original_max_position_embeddings",
                               e.get("original_max_position_embeddings"))
        return RotaryEmbedding(int(config.head_dim * partial), config.max_position_embeddings,
                               config.rope_theta, scaling or None)

    def convert_weights(self, weights):
        return split_fused(weights, self.config)


def split_fused(weights, c: ModelConfig):
    """Split a checkpoint's fused qkv_proj and gate_up_proj (Phi-3's; GLM-4's gate_up_proj) into
    Hugging Face's usual q/k/v_proj and gate/up_proj tensors."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    for name, tensor in weights:
        if ".qkv_proj." in name:
            for part, t in zip("qkv", tensor.split([q, kv, kv])):
                yield name.replace(".qkv_proj.", f".{part}_proj."), t
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor
