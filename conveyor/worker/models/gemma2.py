"""Gemma 2: Llama's attention and gated MLP with Gemma's differences.

- RMSNorm scales by (1 + weight): the weight is stored here as 1 + the checkpoint's, so the
  plain RMSNorm (and its fused kernels) compute it;
- four norms a layer: the attention and MLP outputs are normalised too, before each joins the
  residual stream (post_attention / pre_feedforward / post_feedforward layernorms);
- embeddings times sqrt(hidden_size) (in the model dtype, as transformers rounds it);
- GELU (tanh approximation) gating instead of SiLU;
- attention scale query_pre_attn_scalar^-0.5, attention logits soft-capped
  (attn_logit_softcapping), and so are the final logits (final_logit_softcapping);
- sliding-window attention on every other layer (config.layer_windows).
The rest is LlamaModel's (its decoder-layer, final-norm and MLP hooks). Gemma 3 (gemma3.py)
builds on this.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.activation import gelu_tanh_and_mul
from conveyor.worker.layers.linear import default_weight_loader
from conveyor.worker.layers.norm import RMSNorm
from conveyor.worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w) for the checkpoint's w: loads 1 + w into the plain RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__(hidden_size, eps, dtype)
        self.weight.weight_loader = lambda param, w, shard_id=None: default_weight_loader(
            param, w.float() + 1)


class GemmaMLP(LlamaMLP):
    """Llama's projections with a tanh-GELU gate instead of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    """Norms before and after each sublayer (GLM-4's layer too, with plain RMSNorms)."""
    output_reduced = True                    # its last norm reduces the MLP's partial sums
    norm = GemmaRMSNorm

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attention_options: dict, mlp: nn.Module, residual_multiplier: float = 1.0):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype, **attention_options)
        self.mlp = mlp
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = self.norm(h, eps, dtype)
        self.post_attention_layernorm = self.norm(h, eps, dtype)
        self.pre_feedforward_layernorm = self.norm(h, eps, dtype)
        self.post_feedforward_layernorm = self.norm(h, eps, dtype)

    def forward(self, x, residual, cos, sin, ctx):
        """As LlamaDecoderLayer.forward, x in and out is still to be added to the residual; but
        it is whole under tensor parallelism: the attention's and the MLP's partial sums are
        reduced by the norms right after them (post_attention, post_feedforward)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin, ctx), reduce=True)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x), reduce=True), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma2DecoderLayer
    final_norm = GemmaRMSNorm

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        e = config.extra
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias,
                "scale": (e.get("query_pre_attn_scalar") or config.head_dim) ** -0.5,
                "softcap": float(e.get("attn_logit_softcapping") or 0.0)}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return GemmaMLP(config, dtype)

    @staticmethod
    def extra_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensors of a layer beyond Llama's (for load_format="dummy")."""
        h = config.hidden_size
        return {"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self.model.embedding_multiplier = embedding_scale(config, dtype)
        self.final_softcap = float(config.extra.get("final_logit_softcapping") or 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def embedding_scale(config: ModelConfig, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to the model dtype, as transformers' embed_scale buffer."""
    return float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device="cpu"))
