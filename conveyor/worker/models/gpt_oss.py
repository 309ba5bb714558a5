"""OpenAI's gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's decoder with biases on q, k, v and o,
attention sinks (a learned logit per head in each softmax's denominator), sliding-window
(`sliding_window`, 128) and full attention layers alternating (`layer_types`), YaRN rope, and
in every layer a mixture of num_local_experts experts of width intermediate_size,
num_experts_per_tok a token: a router with a bias, a softmax over the top K logits, experts with
biases and the clamped SwiGLU (swiglu_alpha 1.702, swiglu_limit 7).

The checkpoint stacks each layer's experts (`mlp.experts.gate_up_proj` [E, H, 2I], gate and up
interleaved along the last dim, `down_proj` [E, I, H], and their biases [E, 2I], [E, H]); the
published one stores the two projections in MXFP4 (`*_blocks`, `*_scales`,
worker/mxfp4_checkpoint.py), which load as 4-bit words and the scale bytes where the loader
made the experts take them (FusedMoE.make_mxfp4), else dequantized. Both are split into
Qwen3-MoE's per-expert names (gate and up de-interleaved), and `mlp.router` is loaded as
`mlp.gate`.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.moe import FusedMoE, SparseMoeBlock, per_expert
from conveyor.worker.layers.pipeline import stage_weight_name
from conveyor.worker.models.llama import LlamaForCausalLM
from conveyor.worker.mxfp4_checkpoint import dequantize_mxfp4, mxfp4_words

_PROJECTIONS = (".experts.gate_up_proj", ".experts.down_proj")
# the stacked experts split per expert, gate and up interleaved along their rows
_gpt_oss_experts = functools.partial(per_expert, interleaved=True)


class GptOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias,
                "sinks": True}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        e = config.extra
        swiglu = (float(e.get("swiglu_alpha") or 1.702), float(e.get("swiglu_limit") or 7.0))
        return SparseMoeBlock(e["num_local_experts"], e["num_experts_per_tok"],
                              config.hidden_size, config.intermediate_size, True, dtype,
                              bias=True, swiglu=swiglu, softmax_after_topk=True)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")

    def convert_weights(self, weights):
        """The checkpoint's tensors under the names and layout load_weights takes: stacked
        experts (bf16, or MXFP4 blocks and scales, which may come in either order and from
        different files) split per expert; everything else renamed only."""
        mxfp4: dict[str, dict[str, torch.Tensor]] = {}      # projection -> blocks, scales
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name.endswith(("_blocks", "_scales")) and ".experts." in name:
                proj, part = name.rsplit("_", 1)
                parts = mxfp4.setdefault(proj, {})
                parts[part] = tensor
                if len(parts) == 2:
                    del mxfp4[proj]
                    # another pipeline stage's layers are not converted here at all
                    if stage_weight_name(proj, self.config.num_hidden_layers, False):
                        yield from self._mxfp4_experts(proj, parts["blocks"], parts["scales"])
            elif name.endswith(_PROJECTIONS):                # [E, inputs, rows]
                yield from _gpt_oss_experts(name, tensor.transpose(1, 2))
            elif name.endswith(tuple(p + "_bias" for p in _PROJECTIONS)):
                yield from _gpt_oss_experts(name.removesuffix("_bias"), tensor, "bias")
            else:
                yield name, tensor
        if mxfp4:
            raise ValueError(f"MXFP4 experts without their blocks or scales: {sorted(mxfp4)}")

    def _mxfp4_experts(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor):
        """Each expert's words and scale bytes (`weight`, `weight_scale`) where the experts take
        MXFP4, else each dequantized in turn (on the experts' device, in their dtype): beside
        the model's own weights, at most one expert's projection is held in full precision."""
        experts = next((m for m in self.modules() if isinstance(m, FusedMoE)), None)
        if experts is not None and experts.fp4:
            words, scales = mxfp4_words(blocks, scales)
            yield from _gpt_oss_experts(proj, words)
            yield from _gpt_oss_experts(proj, scales, "weight_scale")
            return
        device = experts.w13.device if experts is not None else torch.device("cpu")
        dtype = experts.w13.dtype if experts is not None else torch.float32
        for e in range(blocks.shape[0]):
            w = dequantize_mxfp4(blocks[e].to(device), scales[e].to(device), dtype)
            yield from _gpt_oss_experts(proj, w[None], first=e)
