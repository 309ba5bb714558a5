"""DeepSeek-V2 and -V3 (`DeepseekV2ForCausalLM`: DeepSeek-V2, V2-Lite; `DeepseekV3ForCausalLM`:
DeepSeek-V3, R1, Kimi-K2, Moonlight; `Glm4MoeLiteForCausalLM`: GLM-4.7-Flash, V3's layers with
its dense ones listed in mlp_layer_types; `Mistral4ForCausalLM`: Mistral Small 4, below):
multi-head latent attention (MLA), and after the first first_k_dense_replace dense layers a
mixture of n_routed_experts experts of width moe_intermediate_size plus n_shared_experts shared
ones every token runs (one MLP of their summed width). GLM-4.5's mixture (models/glm4_moe.py)
is V3's.

MLA: each head's query from the hidden state (q_proj, or the low-rank q_a_proj, q_a_layernorm,
q_b_proj), qk_nope_head_dim features without the rotary embedding and qk_rope_head_dim with it;
a latent of kv_lora_rank (kv_a_proj_with_mqa, kv_a_layernorm) beside one rotary key part shared
by all heads; kv_b_proj expands the latent into each head's key part and value. The paged pool
holds the expanded keys and values, as multi-head attention with head_dim qk_nope + qk_rope (each
value padded with zeros to it): exact, on the same attention kernels, for a pool that takes
num_heads x 2 x head_dim a token where the latent would take kv_lora_rank + qk_rope (the
absorbed form, which keeps the latent in the pool, is not built). The checkpoint's rotary pairs
are interleaved ((x0, x1), (x2, x3), ...): taken here as halves (evens, then odds) of q's and
k's rotary features alike, which leaves their dot products as the model's (rope_interleave
false: halves already, as Llama's). With YaRN the
softmax scale takes mscale_all_dim's factor squared, as the reference does.

Routers (layers/router.py): V3's sigmoid scores with a correction bias, the experts in n_group
groups ranked by their best two, the top K renormalised (norm_topk_prob) and scaled
(routed_scaling_factor); V2's softmax, its top K taken directly (topk_method "greedy") or from
the topk_group groups with the best single expert ("group_limited_greedy"), scaled.

The published V3 checkpoints add num_nextn_predict_layers multi-token-prediction layers after
the last decoder layer, which serving without them leaves out, as transformers does.
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.context import StepContext
from conveyor.worker.layers.attention import Attention
from conveyor.worker.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from conveyor.worker.layers.moe import FusedMoE, split_stacked
from conveyor.worker.layers.norm import RMSNorm
from conveyor.worker.layers.parallel import divide, tp_size
from conveyor.worker.layers.rotary import RotaryEmbedding, apply_rotary
from conveyor.worker.layers.router import GroupedTopKRouter
from conveyor.worker.models.llama import LlamaForCausalLM, LlamaMLP

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class MlaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        e, h, eps = config.extra, config.hidden_size, config.rms_norm_eps
        heads, bias = config.num_attention_heads, bool(e.get("attention_bias"))
        self.nope, self.rope = e["qk_nope_head_dim"], e["qk_rope_head_dim"]
        self.v_dim, self.lora = e["v_head_dim"], e["kv_lora_rank"]
        self.qk = self.nope + self.rope
        self.interleaved = bool(e.get("rope_interleave", True))
        if self.v_dim > self.qk:
            raise ValueError(f"v_head_dim {self.v_dim} is wider than a key ({self.qk})")
        q_lora = e.get("q_lora_rank")
        if q_lora:
            self.q_a_proj = ReplicatedLinear(h, q_lora, bias, dtype)
            self.q_a_layernorm = RMSNorm(q_lora, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(q_lora, heads * self.qk, False, dtype)
        else:
            self.q_proj = ColumnParallelLinear(h, heads * self.qk, False, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.lora + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.lora, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.lora, heads * (self.nope + self.v_dim),
                                              False, dtype)
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, bias, dtype,
                                        reduce_results=False)
        self.heads = divide(heads, tp_size())
        scale = self.qk ** -0.5
        scaling = config.rope_scaling or {}
        if scaling.get("mscale_all_dim") and scaling.get("factor", 1) > 1:
            scale *= (0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1) ** 2
        self.attn = Attention(layer_idx, self.heads, self.heads, self.qk, scale=scale,
                              window=config.window(layer_idx))

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """name (within the attention) -> shape of its checkpoint tensors."""
        e, h, heads = config.extra, config.hidden_size, config.num_attention_heads
        qk, lora, rope = config.head_dim, e["kv_lora_rank"], e["qk_rope_head_dim"]
        q_lora, v = e.get("q_lora_rank"), e["v_head_dim"]
        shapes = ({"q_a_proj.weight": (q_lora, h), "q_a_layernorm.weight": (q_lora,),
                   "q_b_proj.weight": (heads * qk, q_lora)} if q_lora
                  else {"q_proj.weight": (heads * qk, h)})
        shapes.update({"kv_a_proj_with_mqa.weight": (lora + rope, h),
                       "kv_a_layernorm.weight": (lora,),
                       "kv_b_proj.weight": (heads * (qk - rope + v), lora),
                       "o_proj.weight": (h, heads * v)})
        if e.get("attention_bias"):
            shapes.update({"kv_a_proj_with_mqa.bias": (lora + rope,), "o_proj.bias": (h,)}
                          | ({"q_a_proj.bias": (q_lora,)} if q_lora else {}))
        return shapes

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        return False                          # its first projections read x as it is

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj")
             else self.q_proj(x)).view(t, self.heads, self.qk)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, self.heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rot = apply_rotary(q[..., self.nope:], cos, sin, self.interleaved)
        k_rot = apply_rotary(k_rot.view(t, 1, self.rope), cos, sin, self.interleaved)
        q = torch.cat((q[..., :self.nope], q_rot), dim=-1)
        if ctx.q_scale is not None:                     # Mistral Small 4's, by position
            q = q * ctx.q_scale.to(q.dtype)
        k = torch.cat((k_nope, k_rot.expand(t, self.heads, self.rope)), dim=-1)
        v = F.pad(v, (0, self.qk - self.v_dim))
        out = self.attn(q.reshape(t, -1), k, v, ctx).view(t, self.heads, self.qk)
        return self.o_proj(out[..., :self.v_dim].reshape(t, -1))


class DeepseekMoeBlock(nn.Module):
    """The router (`gate`), the routed experts and the shared ones (`shared_experts`). An
    expert's width is moe_intermediate_size, else (MiniMax-M2's) intermediate_size; ERNIE 4.5
    names its counts moe_num_experts, moe_k and moe_num_shared_experts, K-EXAONE num_experts
    and num_shared_experts. bias, group_top2: see
    GroupedTopKRouter; renormalize: the chosen experts' weights to sum to 1 (default:
    norm_topk_prob, else with sigmoid scores only)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, softmax: bool = False,
                 bias: bool | None = None, renormalize: bool | None = None,
                 group_top2: bool | None = None):
        super().__init__()
        e = config.extra
        experts = (e.get("n_routed_experts") or e.get("num_local_experts")
                   or e.get("num_experts") or e["moe_num_experts"])
        top_k = e.get("num_experts_per_tok") or e["moe_k"]
        width = e.get("moe_intermediate_size") or config.intermediate_size
        if renormalize is None:
            renormalize = bool(e.get("norm_topk_prob", not softmax))
        n_group, topk_group = e.get("n_group") or 1, e.get("topk_group") or 1
        if softmax and not group_top2 and e.get("topk_method", "greedy") == "greedy":
            n_group = topk_group = 1                    # V2's greedy: no groups
        self.gate = GroupedTopKRouter(experts, config.hidden_size, top_k, n_group, topk_group,
                                      renormalize, float(e.get("routed_scaling_factor") or 1.0),
                                      softmax, bias, group_top2)
        self.experts = FusedMoE(experts, top_k, config.hidden_size, width, renormalize, dtype)
        shared = (e.get("n_shared_experts") or e.get("moe_num_shared_experts")
                  or e.get("num_shared_experts") or 0)
        self.shared_experts = LlamaMLP(config, dtype, width * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial sums [T, H]."""
        out = self.experts.mix(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def without_mtp_layers(weights, num_layers: int):
    """A checkpoint's tensors less those of layers from num_layers on (multi-token
    prediction's)."""
    for name, tensor in weights:
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < num_layers:
            yield name, tensor


def dense_layer(config: ModelConfig, layer_idx: int) -> bool:
    """Whether the layer has a dense MLP, not experts: as mlp_layer_types says ("dense" or
    "sparse"), else the first first_k_dense_replace layers and those off moe_layer_freq."""
    e = config.extra
    if e.get("mlp_layer_types"):
        return e["mlp_layer_types"][layer_idx] == "dense"
    return (layer_idx < (e.get("first_k_dense_replace") or 0)
            or layer_idx % (e.get("moe_layer_freq") or 1) != 0)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    # q, k and v are MLA's own projections: only the MLPs' gate and up are fused
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    softmax_router = False
    group_top2 = None                    # GroupedTopKRouter's (None: as the scores say)

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        return {"module": MlaAttention}

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.extra["qk_rope_head_dim"], config.max_position_embeddings,
                               config.rope_theta, config.rope_scaling)

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if dense_layer(config, layer_idx):
            return LlamaMLP(config, dtype)
        return DeepseekMoeBlock(config, dtype, cls.softmax_router, group_top2=cls.group_top2)

    def convert_weights(self, weights):
        return without_mtp_layers(weights, self.config.num_hidden_layers)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    softmax_router = True


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral Small 4: V3's layers with V2's softmax scores (no bias) ranked in groups by
    their best two, and each query scaled by position (llama_4_scaling_beta, LlamaModel)."""
    softmax_router = True
    group_top2 = True

    def convert_weights(self, weights):
        """Experts stacked as transformers saves them split per expert."""
        return super().convert_weights(split_stacked(weights))
