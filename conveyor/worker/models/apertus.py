"""Apertus (`ApertusForCausalLM`: Swiss AI's Apertus-8B/70B): Llama with Qwen3's per-head q/k
RMSNorms, its norms named attention_layernorm and feedforward_layernorm, and an MLP without a
gate whose activation is xIELU (UpDownMLP): with a layer's learned alpha_p, alpha_n and its
beta, eps,

    xielu(x) = softplus(alpha_p) x^2 + beta x                                   for x > 0
             = (beta + softplus(alpha_n)) (expm1(min(x, eps)) - x) + beta x     otherwise,

in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models.llama import QKV_PACKED, LlamaForCausalLM, UpDownMLP, renamer


class XIELU(nn.Module):
    def __init__(self):
        super().__init__()
        for name in ("alpha_p", "alpha_n", "beta", "eps"):   # [1], [1], scalars (checkpoint's)
            shape = (1,) if name.startswith("alpha") else ()
            setattr(self, name, nn.Parameter(torch.zeros(shape), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf, beta = x.float(), self.beta.float()
        alpha_p = F.softplus(self.alpha_p.float())
        alpha_n = beta + F.softplus(self.alpha_n.float())
        out = torch.where(xf > 0, alpha_p * xf * xf + beta * xf,
                          (torch.expm1(torch.minimum(xf, self.eps.float())) - xf) * alpha_n
                          + beta * xf)
        return out.to(x.dtype)


class ApertusForCausalLM(LlamaForCausalLM):
    packed_modules = QKV_PACKED
    checkpoint_name = renamer({".attention_layernorm.": ".input_layernorm.",
                               ".feedforward_layernorm.": ".post_attention_layernorm."})

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias,
                "qk_norm": True}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if config.extra.get("hidden_act", "xielu") != "xielu":
            raise ValueError(f"Apertus with hidden_act {config.extra['hidden_act']!r} is not "
                             f"supported (xielu only)")
        return UpDownMLP(config, dtype, XIELU())

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
        return {**UpDownMLP.checkpoint_shapes(config, False), "mlp.act_fn.alpha_p": (1,),
                "mlp.act_fn.alpha_n": (1,), "mlp.act_fn.beta": (), "mlp.act_fn.eps": ()}
