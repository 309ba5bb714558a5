"""EXAONE 4.0 (`Exaone4ForCausalLM`, LG AI Research's EXAONE-4.0-1.2B and -32B): OLMo 2's
decoder (norms after the sublayers, models/olmo2.py) with Qwen3's RMSNorm over each head of q
and k, and, where the config has a sliding window, three sliding layers of four
(sliding_window_pattern) that take the rotary embedding while the full-attention layers take
none (NoPE).
"""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.llama import LlamaForCausalLM
from conveyor.worker.models.olmo2 import OlmoDecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    decoder_layer = OlmoDecoderLayer

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": True}

    @staticmethod
    def nope_layers(config: ModelConfig) -> frozenset[int]:
        if not config.layer_windows:
            return frozenset()
        return frozenset(i for i in range(config.num_hidden_layers) if not config.window(i))

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
        """A layer's checkpoint tensors beyond Llama's, or in place of them (None: not there),
        for load_format="dummy"."""
        return {"input_layernorm.weight": None,
                "post_feedforward_layernorm.weight": (config.hidden_size,)}
