"""Rotary position embedding, in the "rotate half" layout of Hugging Face Llama and Qwen.

cos/sin are precomputed in float32 for every position up to max_position and looked up once
per step; `apply_rotary` then rotates q or k of every layer. Supports the default schedule,
"linear" and Llama 3.x "llama3" frequency scaling, and Phi-3's "longrope" (alias "su"): the
short factors below original_max_position_embeddings and the long ones from there on, chosen
per position, with cos/sin times the attention factor. (transformers re-encodes a whole
sequence with the long factors once it passes that length; a paged cache keeps the keys it
has, so positions before it keep the short factors here.) "yarn" (gpt-oss) blends interpolated
and original frequencies along a ramp between two correction dimensions, and scales cos/sin by
its attention factor. With a partial rotary embedding (Phi-4-mini), only the first
`rotary_dim` features of each head turn.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _kind(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = _kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported "
                     f"(supported: default, linear, llama3, longrope, yarn)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths slowed down by `factor`, short ones kept, a smooth blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, base: float, scaling: dict[str, Any], max_position: int
          ) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor, as transformers computes them
    (modeling_rope_utils._compute_yarn_parameters): the frequencies that turn fewer than
    beta_slow times over the original context are divided by `factor`, those that turn more
    than beta_fast times are kept, with a linear ramp between (its ends floored and ceiled
    unless `truncate` is false); the attention factor is given, or 0.1 ln(factor) + 1 (with
    mscale and mscale_all_dim, their ratio)."""
    orig = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor") or max_position / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        """The dimension whose frequency turns `rotations` times over the original context."""
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                    # as transformers: no division by 0
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp                                      # 1: the original frequency
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope_freqs(positions: torch.Tensor, dim: int, base: float, scaling: dict[str, Any],
                    max_position: int) -> tuple[torch.Tensor, float]:
    """Angles [P, dim / 2] (short factors before original_max_position_embeddings, long from
    there) and the attention factor that scales cos and sin."""
    orig = scaling["original_max_position_embeddings"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (torch.tensor(scaling[k], dtype=torch.float32) * base ** exponents)
                   for k in ("short_factor", "long_factor"))
    freqs = torch.where((positions < orig)[:, None], torch.outer(positions, short),
                        torch.outer(positions, long))
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = scaling.get("factor") or max_position / orig
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return freqs, attention


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None):
        """head_dim: the features that turn (the rotary dim, where only part of a head turns)."""
        super().__init__()
        positions = torch.arange(max_position).float()
        attention = 1.0
        if _kind(scaling) in ("longrope", "su"):
            freqs, attention = _longrope_freqs(positions, head_dim, base, scaling, max_position)
        elif _kind(scaling) == "yarn":
            inv_freq, attention = _yarn(head_dim, base, scaling, max_position)
            freqs = torch.outer(positions, inv_freq)
        else:
            freqs = torch.outer(positions, _inv_freq(head_dim, base, scaling))
        self.register_buffer("cos", freqs.cos() * attention, persistent=False)   # [P, dim / 2]
        self.register_buffer("sin", freqs.sin() * attention, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]              # [T, head_dim / 2] each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, rotary_dim / 2], in x's dtype; features past
    rotary_dim pass unchanged. interleaved: x's rotary pairs are neighbours (2i, 2i + 1), as in
    GLM-4's and DeepSeek's checkpoints; they come out as halves (i, i + rotary_dim / 2), the
    pairs' first members then their second ones. Applied to q and k alike, that reorders both
    the same way, which leaves every q.k product as the interleaved rotation makes it."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin, interleaved),
                          x[..., rotary_dim:]), -1)
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def layer_type_ropes(extra: dict[str, Any], full_theta: float, local_theta: float,
                     local_key: str | None = None
                     ) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """(base, scaling) of the full-attention layers' rotary embedding and of the sliding ones',
    for the families that give each layer type its own (Gemma 3, OLMo 3): from transformers
    >= 5's rope_parameters keyed by layer type, else from the hub's config.json, whose
    rope_theta and rope_scaling are the full layers' (the sliding ones take `local_key`'s base,
    else rope_theta, and no scaling). The theta arguments are the family's defaults."""
    params = extra.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return _base_and_scaling(params["full_attention"], full_theta), _base_and_scaling(
            params.get("sliding_attention"), local_theta)
    full = float(extra.get("rope_theta") or full_theta)
    local = float(extra.get(local_key) or local_theta) if local_key else full
    return (full, extra.get("rope_scaling") or None), (local, None)


def _base_and_scaling(params: dict[str, Any] | None, theta: float) -> tuple[float, dict | None]:
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return float(params.get("rope_theta", theta)), (None if kind == "default" else params)
