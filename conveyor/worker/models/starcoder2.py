"""StarCoder2 (`Starcoder2ForCausalLM`: starcoder2-3b/7b/15b and their instruct tunes): Llama's
attention with biases on every projection (use_bias) and a sliding window on every layer, its
norms LayerNorms with a bias, and an MLP without a gate (the checkpoint's c_fc, tanh-GELU, c_proj,
with biases; loaded as UpDownMLP's up_proj and down_proj).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.norm import LayerNorm
from conveyor.worker.models.llama import (
    QKV_PACKED,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    UpDownMLP,
    renamer,
)

_NORM = partial(LayerNorm, bias=True)


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    norm = _NORM


class Starcoder2ForCausalLM(LlamaForCausalLM):
    packed_modules = QKV_PACKED
    checkpoint_name = renamer({".mlp.c_fc.": ".mlp.up_proj.", ".mlp.c_proj.": ".mlp.down_proj."})
    decoder_layer = Starcoder2DecoderLayer
    final_norm = _NORM

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        bias = bool(config.extra.get("use_bias", True))
        return {"qkv_bias": bias, "o_bias": bias}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return UpDownMLP(config, dtype, partial(F.gelu, approximate="tanh"),
                         bool(config.extra.get("use_bias", True)))

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
        """For load_format="dummy": the norms' biases, and the ungated MLP."""
        h = config.hidden_size
        return {"input_layernorm.bias": (h,), "post_attention_layernorm.bias": (h,),
                **UpDownMLP.checkpoint_shapes(config, bool(config.extra.get("use_bias", True)))}

    @staticmethod
    def extra_model_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {"model.norm.bias": (config.hidden_size,)}
