"""Llama 4 (`Llama4ForCausalLM`, and `Llama4ForConditionalGeneration` served for its text:
Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E): Llama's decoder with
- rotary pairs interleaved (neighbouring features); a layer that takes the rotary embedding
  (no_rope_layers 1; three of four) attends within its chunk of attention_chunk_size
  positions (a query sees its chunk's keys up to itself) and normalises q and k per head
  without a weight after the rotation (use_qk_norm); a layer without it (NoPE) sees everything,
  its queries scaled by 1 + attn_scale * log(1 + floor((position + 1) / floor_scale))
  (attn_temperature_tuning; models/llama.py's query_temperature);
- in the layers moe_layers lists (every interleave_moe_layer_step-th) num_local_experts experts
  of width intermediate_size, num_experts_per_tok a token by the sigmoid of their router logit,
  which scales the token going into the expert, beside a shared expert every token runs; the
  other layers a dense MLP of intermediate_size_mlp.
The checkpoint's `feed_forward` is our `mlp`, its `router` our `gate`; its experts come stacked
as [E, inputs, outputs] (gate_up_proj's outputs gate's then up's) and are split per expert.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.linear import ReplicatedLinear
from conveyor.worker.layers.moe import FusedMoE, split_stacked
from conveyor.worker.layers.norm import WeightlessRMSNorm
from conveyor.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, renamer


def _takes_rope(config: ModelConfig, layer_idx: int) -> bool:
    """no_rope_layers' 1 at the layer; without the list (or with an empty one, as transformers
    reads it), every fourth layer is NoPE (no_rope_layer_interval)."""
    rope = config.extra.get("no_rope_layers")
    interval = config.extra.get("no_rope_layer_interval") or 4
    return bool(rope[layer_idx]) if rope else (layer_idx + 1) % interval != 0


class Llama4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with its attention's options for its kind (the module docstring)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attention_options: dict, mlp: nn.Module, residual_multiplier: float = 1.0):
        e = config.extra
        rope = _takes_rope(config, layer_idx)
        options = dict(attention_options, scaled_queries=not rope,
                       chunk=int(e.get("attention_chunk_size") or 0) if rope else 0)
        if rope and e.get("use_qk_norm", True):
            options.update(qk_norm=True, norm=WeightlessRMSNorm, norm_after_rotary=True)
        super().__init__(config, layer_idx, dtype, options, mlp, residual_multiplier)


class Llama4MoeBlock(nn.Module):
    """The router (`gate`), the experts (FusedMoE taking their weights on the way in) and the
    shared expert."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        e = config.extra
        experts, self.top_k = e["num_local_experts"], e.get("num_experts_per_tok", 1)
        self.gate = ReplicatedLinear(config.hidden_size, experts, dtype=dtype)
        self.gate.keep_precision = True
        self.experts = FusedMoE(experts, self.top_k, config.hidden_size,
                                config.intermediate_size, False, dtype, weight_inputs=True)
        self.shared_expert = LlamaMLP(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial sums [T, H]."""
        values, ids = torch.topk(self.gate(x), self.top_k, dim=-1)
        weights = torch.sigmoid(values.float()).to(x.dtype)
        return self.experts.mix(x, weights, ids.to(torch.int32)) + self.shared_expert(x)


class Llama4ForCausalLM(LlamaForCausalLM):
    decoder_layer = Llama4DecoderLayer
    checkpoint_name = renamer({".feed_forward.router.": ".mlp.gate.",
                               ".feed_forward.": ".mlp."})

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias,
                "interleaved": True}

    @staticmethod
    def nope_layers(config: ModelConfig) -> frozenset[int]:
        return frozenset(i for i in range(config.num_hidden_layers)
                         if not _takes_rope(config, i))

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        e = config.extra
        step = e.get("interleave_moe_layer_step") or 1
        moe = e.get("moe_layers")
        moe = range(step - 1, config.num_hidden_layers, step) if moe is None else moe
        if layer_idx in moe:
            return Llama4MoeBlock(config, dtype)
        return LlamaMLP(config, dtype, e.get("intermediate_size_mlp"))

    def convert_weights(self, weights):
        """Stacked experts [E, inputs, outputs] split per expert."""
        return split_stacked(super().convert_weights(weights), transposed=True)
