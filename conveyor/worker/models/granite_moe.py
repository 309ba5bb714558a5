"""Granite 3.x mixture of experts (`GraniteMoeForCausalLM`: granite-3.0-1b-a400m,
granite-3.0-3b-a800m, granite-3.1-*-a*; `GraniteMoeSharedForCausalLM`, with a shared expert
added to the routed ones without a gate): dense Granite's multipliers (models/granite.py) and in
every layer `num_local_experts` experts, `num_experts_per_tok` a token, weighted by a softmax
over the chosen experts' router logits (the same as renormalising a softmax over all of them).
The checkpoint stacks each layer's experts: `block_sparse_moe.input_linear` [E, 2I, H] (gate
rows, then up rows), `output_linear` [E, H, I], the router `block_sparse_moe.router.layer`, the
shared expert `shared_mlp.input_linear` / `output_linear`; they load as Qwen2-MoE's `mlp`.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import SparseMoeBlock, per_expert
from conveyor.worker.models.granite import GraniteForCausalLM
from conveyor.worker.models.llama import LlamaMLP


class GraniteMoeForCausalLM(GraniteForCausalLM):
    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        e = config.extra
        shared = e.get("shared_intermediate_size") or 0
        return SparseMoeBlock(e["num_local_experts"], e["num_experts_per_tok"],
                              config.hidden_size, config.intermediate_size, True, dtype,
                              shared_expert=LlamaMLP(config, dtype, shared) if shared else None,
                              gated_shared=False)

    def convert_weights(self, weights):
        for name, tensor in weights:
            layer, sep, rest = name.partition(".block_sparse_moe.")
            if not sep:
                layer, sep, rest = name.partition(".shared_mlp.")
            if not sep:
                yield name, tensor
                continue
            module, kind = rest.rsplit(".", 1)          # kind: weight, or a scale's name
            if sep == ".shared_mlp.":
                if module == "input_linear":
                    gate, up = tensor.chunk(2)
                    yield f"{layer}.mlp.shared_expert.gate_proj.{kind}", gate
                    yield f"{layer}.mlp.shared_expert.up_proj.{kind}", up
                else:
                    yield f"{layer}.mlp.shared_expert.down_proj.{kind}", tensor
            elif module == "router.layer":
                yield f"{layer}.mlp.gate.{kind}", tensor
            else:
                proj = "gate_up_proj" if module == "input_linear" else "down_proj"
                yield from per_expert(f"{layer}.mlp.experts.{proj}", tensor, kind)
