"""Mixture-of-experts routing: router logits -> each token's K experts (ids [T, K] int32) and
their weights ([T, K] in the activations' dtype), in torch (a few small ops a layer, which CUDA
graphs capture), for FusedMoE to run (kernels/fused_moe.py).

`route`: a softmax over the experts and its top K (Mixtral, Qwen-MoE, gpt-oss's variant).
`GroupedTopKRouter`: DeepSeek-V3's scheme (GLM-4.5's too): sigmoid scores, a learned
correction bias added for the choice only, the experts in n_group groups of which the
topk_group with the best two-expert sums are eligible, the top K of those weighted by their
unbiased scores (renormalised where the model does), times routed_scaling_factor; or
DeepSeek-V2's: softmax scores, no bias, groups ranked by their best expert; or Mistral Small
4's: softmax scores, no bias, groups ranked by their best two as V3's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype,
          softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] in dtype, expert ids [T, K] int32): softmax in
    float32, the top K, renormalised to sum to 1 where the model does (Mixtral; Qwen3-MoE's
    norm_topk_prob); or with softmax_after_topk (gpt-oss) the top K logits, then a softmax
    over those alone (the renormalised weights in exact arithmetic, computed as the model
    does)."""
    if softmax_after_topk:
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values.float(), dim=-1).to(dtype), ids.to(torch.int32)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids.to(torch.int32)


def route_grouped(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
                  topk_group: int, renormalize: bool, scale: float, dtype: torch.dtype,
                  softmax: bool = False, group_top2: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 router logits [T, E] and the correction bias [E] (or None) -> (weights, ids)
    as `route` gives them, by the module docstring's grouped schemes (softmax: V2's; groups
    ranked by their best two experts where group_top2 says, else by their best one)."""
    t, e = logits.shape
    scores = logits.softmax(dim=-1) if softmax else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if topk_group < n_group:
        groups = choice.view(t, n_group, e // n_group)
        group_scores = (groups.topk(2, dim=-1).values.sum(-1) if group_top2
                        else groups.amax(-1))                              # [T, n_group]
        best = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = groups.masked_fill(~eligible[:, :, None], float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scale).to(dtype), ids.to(torch.int32)


class GroupedTopKRouter(nn.Module):
    """The router of the grouped schemes under Hugging Face's names (`gate.weight` [E, H], and
    with sigmoid scores `gate.e_score_correction_bias` [E]), float32 whatever the model's dtype
    (the logits decide which experts run: they are computed in float32, as the reference
    does); replicated on every rank, never quantized. forward(x [T, H]) -> (weights, ids) for
    FusedMoE.mix."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, n_group: int,
                 topk_group: int, renormalize: bool, scale: float, softmax: bool = False,
                 bias: bool | None = None, group_top2: bool | None = None):
        """bias: whether the choice adds a correction bias (default: with sigmoid scores only;
        ERNIE 4.5 adds one to softmax scores); group_top2: groups ranked by their best two
        experts (default: with sigmoid scores only; route_grouped)."""
        super().__init__()
        if num_experts % n_group or num_experts // n_group < 2 or topk_group > n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups of at "
                             f"least 2 with {topk_group} of them chosen")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize, self.scale, self.softmax = renormalize, scale, softmax
        self.group_top2 = not softmax if group_top2 is None else group_top2
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        if bias is None:
            bias = not softmax
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return route_grouped(logits, self.e_score_correction_bias, self.top_k, self.n_group,
                             self.topk_group, self.renormalize, self.scale, x.dtype,
                             self.softmax, self.group_top2)
