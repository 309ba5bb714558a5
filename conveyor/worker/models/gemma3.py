"""Gemma 3 (text): Gemma 2 (gemma2.py) with an RMSNorm (1 + weight) over each head of q and k,
five sliding-window layers for each global one, and a rotary base of its own for the sliding
layers (rope_local_base_freq, 10,000; the global layers' rope_theta is 1,000,000, with the
config's scaling, linear in the larger models). Soft-capping only where the config asks.
"""
from __future__ import annotations

from typing import Any

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.rotary import RotaryEmbedding
from conveyor.worker.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm


def _rope(params: dict[str, Any] | None, theta: float) -> tuple[float, dict | None]:
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return float(params.get("rope_theta", theta)), (None if kind == "default" else params)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {**Gemma2ForCausalLM.attention_options(config), "qk_norm": True,
                "norm": GemmaRMSNorm}

    @staticmethod
    def rotary_embeddings(config: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        e = config.extra
        params = e.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:    # transformers >= 5
            full = _rope(params["full_attention"], 1e6)
            local = _rope(params.get("sliding_attention"), 1e4)
        else:                                                          # the hub's config.json
            full = float(e.get("rope_theta") or 1e6), e.get("rope_scaling") or None
            local = float(e.get("rope_local_base_freq") or 1e4), None
        d, n = config.head_dim, config.max_position_embeddings
        return RotaryEmbedding(d, n, *full), RotaryEmbedding(d, n, *local)
