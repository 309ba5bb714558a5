"""Seed-OSS (`SeedOssForCausalLM`: ByteDance's Seed-OSS-36B): Llama with a bias on q, k and v
(attention_bias) and, apart from it, on the output projection (attention_out_bias)."""
from __future__ import annotations

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.llama import LlamaForCausalLM


class SeedOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        e = config.extra
        if e.get("mlp_bias"):
            raise ValueError("a Seed-OSS checkpoint with MLP biases (mlp_bias) is not supported")
        return {"qkv_bias": config.attention_bias,
                "o_bias": bool(e.get("attention_out_bias"))}
