"""Gemma 3 (text): Gemma 2 (gemma2.py) with an RMSNorm (1 + weight) over each head of q and k,
five sliding-window layers for each global one, and a rotary base of its own for the sliding
layers (rope_local_base_freq, 10,000; the global layers' rope_theta is 1,000,000, with the
config's scaling, linear in the larger models). Soft-capping only where the config asks.
"""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.rotary import RotaryEmbedding, layer_type_ropes
from conveyor.worker.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {**Gemma2ForCausalLM.attention_options(config), "qk_norm": True,
                "norm": GemmaRMSNorm}

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        """The global layers' and the sliding ones' (LlamaModel's pair)."""
        full, local = layer_type_ropes(config.extra, 1e6, 1e4, "rope_local_base_freq")
        d, n = config.head_dim, config.max_position_embeddings
        return RotaryEmbedding(d, n, *full), RotaryEmbedding(d, n, *local)
