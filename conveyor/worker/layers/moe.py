"""A sparse mixture-of-experts MLP: a router (a replicated linear layer, E logits a token) and
every expert's gate/up and down projections in two stacked weights, run by the fused-MoE kernels
on CUDA (kernels/fused_moe.py) and by its torch reference elsewhere.

Tensor parallelism shards each expert's intermediate dimension, as a column- then row-parallel
MLP: each rank holds rows I/tp of every expert's gate and up, and those columns of its down, so
its output is a partial sum that the next norm all-reduces (like LlamaMLP's).

Checkpoint tensors `experts.{e}.gate_proj|up_proj|down_proj.weight` load through the shard ids
(e, 0), (e, 1) and (e, 2) (loader.py maps the names; `expected_shards` lists them all).
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels import triton_available
from conveyor.worker.layers.linear import ReplicatedLinear, default_weight_loader
from conveyor.worker.layers.parallel import divide, tp_rank, tp_size

# checkpoint name of an expert's projection -> its part (shard id's second item)
EXPERT_PARTS = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size               # each expert's, unsharded
        inter = divide(intermediate_size, tp_size())
        self.inter = inter
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype),
                                requires_grad=False)              # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=dtype),
                               requires_grad=False)
        for param, parts in ((self.w13, (0, 1)), (self.w2, (2,))):
            param.weight_loader = self.weight_loader
            param.expected_shards = {(e, p) for e in range(num_experts) for p in parts}
        self.register_buffer("w13_scale", None)      # [E, 2I] float32 once quantized
        self.register_buffer("w2_scale", None)       # [E, H]

    def quantize(self, mode: str, device: torch.device) -> tuple[int, int]:
        """--quantization int8 / fp8: every expert's rows quantized (one scale a row, as
        layers/quantization.py does for linear layers), on `device`. Returns the bytes before
        and after."""
        from conveyor.worker.layers.quantization import quantize_weight

        before = after = 0
        for name in ("w13", "w2"):
            w = getattr(self, name).data.to(device)
            e, n, k = w.shape
            q, scale = quantize_weight(w.reshape(e * n, k), mode)
            before += w.numel() * w.element_size()
            after += q.numel() * q.element_size() + scale.numel() * 4
            setattr(self, name, nn.Parameter(q.view(e, n, k), requires_grad=False))
            setattr(self, f"{name}_scale", scale.view(e, n))
        return before, after

    def weight_loader(self, param, loaded_weight, shard_id) -> None:
        expert, part = shard_id
        start = tp_rank() * self.inter
        if part == 2:                      # down_proj [H, I]: this rank's columns
            default_weight_loader(param[expert], loaded_weight.narrow(1, start, self.inter))
        else:
            default_weight_loader(param[expert].narrow(0, part * self.inter, self.inter),
                                  loaded_weight.narrow(0, start, self.inter))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router logits [T, E] -> this rank's partial sums [T, H]."""
        from conveyor.kernels.fused_moe import fused_moe, fused_moe_ref, route

        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        scales = (self.w13_scale, self.w2_scale)
        if x.is_cuda and triton_available() and x.dtype != torch.float32:
            return fused_moe(x, self.w13, self.w2, weights, ids, None, *scales)
        return fused_moe_ref(x, self.w13, self.w2, weights, ids, *scales)


class SparseMoeBlock(nn.Module):
    """The router (`gate`) and the experts, under Hugging Face's names (Qwen3-MoE's `mlp`)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype=dtype)
        # NOTE: the router stays in the model dtype under --quantization: its weights are a
        # sliver of the layer's, and a rounded logit flips an expert choice (a different MLP)
        self.gate.keep_precision = True
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
