"""StarCoder2 (`Starcoder2ForCausalLM`: starcoder2-3b/7b/15b and their instruct tunes): Llama's
attention with biases on every projection (use_bias) and a sliding window on every layer, its
norms LayerNorms with a bias, and an MLP without a gate: c_fc, tanh-approximated GELU, c_proj,
both with biases.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from conveyor.worker.layers.norm import LayerNorm
from conveyor.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_NORM = partial(LayerNorm, bias=True)


class Starcoder2MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        bias = bool(config.extra.get("use_bias", True))
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias, dtype)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, dtype,
                                        reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial sums [T, H]."""
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    norm = _NORM


class Starcoder2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Starcoder2DecoderLayer
    final_norm = _NORM

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        bias = bool(config.extra.get("use_bias", True))
        return {"qkv_bias": bias, "o_bias": bias}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return Starcoder2MLP(config, dtype)

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
        """For load_format="dummy": the norms' biases, and c_fc / c_proj for the gated MLP."""
        h, inter = config.hidden_size, config.intermediate_size
        bias = bool(config.extra.get("use_bias", True))
        shapes = {"input_layernorm.bias": (h,), "post_attention_layernorm.bias": (h,),
                  "mlp.gate_proj.weight": None, "mlp.up_proj.weight": None,
                  "mlp.down_proj.weight": None, "mlp.c_fc.weight": (inter, h),
                  "mlp.c_proj.weight": (h, inter)}
        if bias:
            shapes.update({"mlp.c_fc.bias": (inter,), "mlp.c_proj.bias": (h,)})
        return shapes

    @staticmethod
    def extra_model_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {"model.norm.bias": (config.hidden_size,)}
