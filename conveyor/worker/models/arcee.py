"""Arcee (`ArceeForCausalLM`: AFM-4.5B): Llama with an MLP without a gate, its activation ReLU
squared (UpDownMLP).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.llama import QKV_PACKED, LlamaForCausalLM, UpDownMLP


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class ArceeForCausalLM(LlamaForCausalLM):
    packed_modules = QKV_PACKED

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return UpDownMLP(config, dtype, relu2, bool(config.extra.get("mlp_bias")))

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
        return UpDownMLP.checkpoint_shapes(config, bool(config.extra.get("mlp_bias")))
