"""Llama, Mistral (the same decoder with a sliding window, config.json's `sliding_window`, on
every layer) and SmolLM3 (with layers that skip the rotary embedding, `no_rope_layers`): the
decoder the other models reuse. Qwen2 and Qwen3 subclass LlamaForCausalLM
and change only `attention_options`; the MoE families change `make_mlp`, Granite `multipliers`.

Module names follow Hugging Face's, except the fused qkv_proj and gate_up_proj, which the
loader fills through `packed_modules`.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from conveyor.kernels import triton_available
from conveyor.kernels._util import Fp8Rows
from conveyor.shared.model_config import ModelConfig
from conveyor.worker.context import StepContext
from conveyor.worker.layers.attention import Attention
from conveyor.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from conveyor.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from conveyor.worker.layers.norm import RMSNorm, ShardedRMSNorm
from conveyor.worker.layers.parallel import tp_rank, tp_size
from conveyor.worker.layers.pipeline import make_layers, stage
from conveyor.worker.layers.rotary import RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    """Options beyond Llama's, for the families built on it: `qk_norm` (True: Qwen3's RMSNorm
    over each head of q and k; "all": OLMo's over all of q's heads and all of k's), `scale`
    (default head_dim^-0.5), `softcap` of the attention logits, `norm` (the class of q_norm /
    k_norm), `sinks` (gpt-oss: a learned logit per head, `self_attn.sinks`, in each softmax's
    denominator; sharded with the heads), `interleaved` (GLM-4: rotary pairs are neighbouring
    features, layers/rotary.py's apply_rotary), `norm_after_rotary` (Hunyuan: the per-head q/k
    norms after the rotary embedding, not before), `chunk` (Llama 4's chunked attention, the
    layer's chunk size) and `scaled_queries` (whether the queries take the model's scale by
    position, ctx.q_scale; Llama 4's rotary layers do not)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool | str = False,
                 scale: float | None = None, softcap: float = 0.0,
                 norm: type[RMSNorm] = RMSNorm, sinks: bool = False, interleaved: bool = False,
                 norm_after_rotary: bool = False, chunk: int = 0, scaled_queries: bool = True):
        super().__init__()
        d = config.head_dim
        self.interleaved, self.norm_after_rotary = interleaved, norm_after_rotary
        self.scaled_queries = scaled_queries
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, qkv_bias, dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        o_bias, dtype, reduce_results=False)
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = heads * d, kv_heads * d
        self.head_dim = d
        # Qwen3: RMSNorm over each head of q and k, before the rotary embedding; OLMo: over
        # all heads of each (this rank's share of them)
        self.qk_norm_all = qk_norm == "all"
        if self.qk_norm_all:
            if config.num_key_value_heads % tp_size():
                raise ValueError(f"a norm over all {config.num_key_value_heads} KV heads needs "
                                 f"them split evenly over the {tp_size()} ranks")
            self.q_norm = ShardedRMSNorm(self.q_size, config.rms_norm_eps, dtype)
            self.k_norm = ShardedRMSNorm(self.kv_size, config.rms_norm_eps, dtype)
        else:
            self.q_norm = norm(d, config.rms_norm_eps, dtype) if qk_norm else None
            self.k_norm = norm(d, config.rms_norm_eps, dtype) if qk_norm else None
        self.sinks = None
        if sinks:                                                # [heads] of this rank
            self.sinks = nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        self.attn = Attention(layer_idx, heads, kv_heads, d, scale=scale or d ** -0.5,
                              window=config.window(layer_idx), softcap=softcap, chunk=chunk,
                              cache_index=layer_idx - stage().layers(config.num_hidden_layers)[0])

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        return self.qkv_proj.takes_fp8_rows(x)

    @staticmethod
    def _load_sinks(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """This rank's heads of the checkpoint's sinks [num_attention_heads]."""
        n = param.shape[0]
        default_weight_loader(param, loaded_weight.narrow(0, tp_rank() * n, n))

    def forward(self, x: torch.Tensor | Fp8Rows, cos: torch.Tensor, sin: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, -1, self.head_dim)                  # [T, heads, head_dim]
        k = k.reshape(t, -1, self.head_dim)                  # [T, kv_heads, head_dim]
        per_head = self.q_norm is not None and not self.qk_norm_all
        if (q.is_cuda and triton_available() and 2 * cos.shape[-1] == self.head_dim
                and not (self.interleaved or self.norm_after_rotary)):
            # one kernel: q/k norm and rotary in place, k and v stored into the KV pool as well
            from conveyor.kernels.rotary import rotary_qk

            norm = per_head
            store = self.attn.fused_store(v, ctx)
            rotary_qk(q, k, cos, sin, self.q_norm.weight if norm else None,
                      self.k_norm.weight if norm else None,
                      self.q_norm.eps if norm else 1e-6, **store)
            if store:
                k = v = None                            # already in the pool
        else:
            if per_head and not self.norm_after_rotary:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rotary(q, cos, sin, self.interleaved)
            k = apply_rotary(k, cos, sin, self.interleaved)
            if per_head and self.norm_after_rotary:
                q, k = self.q_norm(q), self.k_norm(k)
        if ctx.q_scale is not None and self.scaled_queries:
            q = q * ctx.q_scale.to(q.dtype)
        out = self.attn(q.view(t, -1), k, v, ctx, self.sinks)   # [T, heads * head_dim]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 intermediate_size: int | None = None):
        """intermediate_size: in place of the config's (Qwen2-MoE's shared expert)."""
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.intermediate_size = inter                       # unsharded
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter],
                                                       dtype=dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, dtype=dtype,
                                           reduce_results=False)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        # SiLU-and-mul of the gate/up output happens in down_proj (in its loads when decoding)
        return self.down_proj(self.gate_up_proj(x), silu_mul=True)


class UpDownMLP(nn.Module):
    """up_proj, an activation, down_proj: an MLP without a gate (StarCoder2's tanh-GELU with
    biases, Arcee's ReLU squared, Apertus's xIELU)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, act_fn, bias: bool = False):
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.up_proj = ColumnParallelLinear(h, inter, bias, dtype)
        self.down_proj = RowParallelLinear(inter, h, bias, dtype, reduce_results=False)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial sums [T, H]."""
        return self.down_proj(self.act_fn(self.up_proj(x)))

    @staticmethod
    def checkpoint_shapes(config: ModelConfig, bias: bool) -> dict[str, tuple[int, ...] | None]:
        """A layer's MLP tensors in place of Llama's (load_format="dummy")."""
        h, inter = config.hidden_size, config.intermediate_size
        shapes = {"mlp.gate_proj.weight": None, "mlp.up_proj.weight": (inter, h),
                  "mlp.down_proj.weight": (h, inter)}
        if bias:
            shapes.update({"mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)})
        return shapes


class LlamaDecoderLayer(nn.Module):
    norm = RMSNorm                           # its two norms' class (StarCoder2's LayerNorm)

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 attention_options: dict, mlp: nn.Module, residual_multiplier: float = 1.0):
        super().__init__()
        options = dict(attention_options)
        attention = options.pop("module", LlamaAttention)     # DeepSeek's MLA in place
        self.self_attn = attention(config, layer_idx, dtype, **options)
        self.mlp = mlp
        self.residual_multiplier = residual_multiplier
        self.input_layernorm = self.norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = self.norm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, residual, cos, sin, ctx):
        """Returns this layer's output and the residual stream, still to be added.

        Under tensor parallelism the attention and MLP outputs (o_proj, down_proj) leave each
        rank as partial sums, and the norm after each reduces them (one fused kernel at decode
        sizes); so x, as given and as returned, is a partial sum, except the embedding's.

        With fp8 weights on the GPU the norms hand the projections after them fp8 rows
        (LinearBase.takes_fp8_rows), quantized in the norm's kernel."""
        fp8 = self.self_attn.takes_fp8_rows(x)
        if residual is None:
            x, residual = self.input_layernorm(x, fp8=fp8), x
        else:
            x, residual = self.input_layernorm(x, residual, reduce=True, fp8=fp8)
        x = self._scaled(self.self_attn(x, cos, sin, ctx))
        fp8 = isinstance(self.mlp, LlamaMLP) and self.mlp.gate_up_proj.takes_fp8_rows(x)
        x, residual = self.post_attention_layernorm(x, residual, reduce=True, fp8=fp8)
        return self._scaled(self.mlp(x)), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """An attention or MLP output (a partial sum: the scale commutes with the reduction)
        times the residual multiplier, before it joins the residual stream."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, attention_options: dict,
                 rotary_emb: RotaryEmbedding, make_mlp,
                 multipliers: tuple[float, float] = (1.0, 1.0), layer_class=None,
                 nope: frozenset[int] = frozenset(), norm_class: type[nn.Module] = RMSNorm):
        """nope: the layers without a rotary embedding ("NoPE"); norm_class: the final norm's
        (Cohere's LayerNorm)."""
        super().__init__()
        # pipeline parallel: the embedding on the first stage, the final norm on the last
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
                             if stage().first else None)
        self.embedding_multiplier, residual_multiplier = multipliers
        # OLMo 3's sliding layers turn by a rotary embedding of their own: (full, sliding)
        self.rotary_emb, self.rotary_emb_local = (rotary_emb if isinstance(rotary_emb, tuple)
                                                  else (rotary_emb, None))
        self.local = ({i for i in range(config.num_hidden_layers) if config.window(i)}
                      if self.rotary_emb_local is not None else set())
        layer_class = layer_class or LlamaDecoderLayer
        # a layer's output is a partial sum, unless its own last norm reduces it (OLMo's)
        self.layers_reduce = not getattr(layer_class, "output_reduced", False)
        self.layers, held = make_layers(config.num_hidden_layers, lambda i: layer_class(
            config, i, dtype, attention_options, make_mlp(config, i, dtype), residual_multiplier))
        self.held = slice(held.start, held.stop)
        self.norm = (norm_class(config.hidden_size, config.rms_norm_eps, dtype) if stage().last
                     else None)
        self.nope = nope
        self.temperature = query_temperature(config)

    def forward(self, input_ids, positions, ctx, intermediate=None):
        """intermediate: the previous pipeline stage's (hidden, residual), in place of the
        embedding; a stage before the last returns its own (hidden, residual)."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None     # [T, hidden]
            if self.embedding_multiplier != 1.0:
                x = x * self.embedding_multiplier
        else:
            x, residual = intermediate
        if self.temperature is not None:
            beta, period, offset = self.temperature
            scale = 1 + beta * torch.log1p(torch.floor((positions.float() + offset) / period))
            ctx = replace(ctx, q_scale=scale[:, None, None])
        rope = self.rotary_emb(positions)                    # [T, head_dim / 2] each
        local = self.rotary_emb_local(positions) if self.local else rope
        # a NoPE layer rotates by nothing: cos 1, sin 0 (the fused q/k kernels stay one path)
        still = (torch.ones_like(rope[0]), torch.zeros_like(rope[1])) if self.nope else None
        for i, layer in enumerate(self.layers[self.held], start=self.held.start):
            cos_sin = still if i in self.nope else local if i in self.local else rope
            x, residual = layer(x, residual, *cos_sin, ctx)
        if self.norm is None:
            return x, residual
        return self.norm(x, residual, reduce=self.layers_reduce)[0]


def query_temperature(config: ModelConfig) -> tuple[float, int, int] | None:
    """(beta, period, offset) where the model scales its queries by position, each by 1 +
    beta * log(1 + floor((position + offset) / period)), so attention sharpens past each
    multiple of the trained context: Llama 4's temperature tuning (attn_scale, floor_scale,
    offset 1; on its layers without the rotary embedding), and from the rotary parameters'
    `llama_4_scaling_beta` (Ministral 3, Devstral 2, Mistral Small 4: period the rotary
    embedding's original_max_position_embeddings, offset 0)."""
    e = config.extra
    if e.get("attn_temperature_tuning") and e.get("floor_scale"):
        return float(e.get("attn_scale", 0.1)), int(e["floor_scale"]), 1
    params = e.get("rope_parameters") or e.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return None
    period = params.get("original_max_position_embeddings")
    if not period:
        raise ValueError("llama_4_scaling_beta needs the rotary parameters' "
                         "original_max_position_embeddings")
    return float(beta), int(period), 0


# checkpoint module name -> (our fused module, shard id in it): q, k and v; the families whose
# MLP has no gate (UpDownMLP) pack only these
QKV_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
              "v_proj": ("qkv_proj", "v")}


def renamer(names: dict[str, str]) -> staticmethod:
    """A `checkpoint_name` replacing each key of `names` (a part of a tensor's name) by its
    value, all in one pass (a key may be another's value: GLM-4's norms)."""
    pattern = re.compile("|".join(map(re.escape, names)))
    return staticmethod(lambda name: pattern.sub(lambda m: names[m.group(0)], name))


class LlamaForCausalLM(nn.Module):
    packed_modules = {**QKV_PACKED, "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    decoder_layer = None                     # LlamaDecoderLayer, or a family's (OLMo's)
    final_norm = RMSNorm                     # the model's last norm (Cohere's LayerNorm)

    @staticmethod
    def attention_options(config: ModelConfig) -> dict:
        """Keyword arguments of LlamaAttention that vary by model family."""
        return {"qkv_bias": config.attention_bias, "o_bias": config.attention_bias}

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """Layer layer_idx's MLP (a mixture of experts in the MoE families)."""
        return LlamaMLP(config, dtype)

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                               config.rope_theta, config.rope_scaling)

    @staticmethod
    def nope_layers(config: ModelConfig) -> frozenset[int]:
        """The layers without a rotary embedding: SmolLM3's no_rope_layers (0 at a layer)."""
        return frozenset(i for i, rope in enumerate(config.extra.get("no_rope_layers") or [])
                         if not rope)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name as this model loads it (`renamer`'s where a family's
        checkpoint names a module otherwise); the loader also groups a quantized checkpoint's
        parts by it."""
        return name

    def convert_weights(self, weights):
        """The checkpoint's (name, tensor) pairs as load_weights takes them: renamed here; a
        family whose tensors are laid out otherwise (Phi-3's fused qkv) maps them too."""
        for name, tensor in weights:
            yield self.checkpoint_name(name), tensor

    @staticmethod
    def multipliers(config: ModelConfig) -> tuple[float, float]:
        """(embedding, residual): the embeddings' multiplier, and that of every attention and
        MLP output before it joins the residual stream (Granite's; 1 elsewhere)."""
        return 1.0, 1.0

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, self.attention_options(config),
                                self.rotary_embedding(config), self.make_mlp,
                                self.multipliers(config), self.decoder_layer,
                                self.nope_layers(config), self.final_norm)
        self.lm_head = lm_head(config, dtype, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: StepContext, intermediate=None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (a pipeline stage before
        the last: its (hidden, residual); intermediate: those of the stage before)."""
        return self.model(input_ids, positions, ctx, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model's dtype.

        NOTE: not upcast here: the fused sampler reads bf16 logits as they are (a float32 copy
        at batch 256 x 151,936 is a 114 us kernel); the torch sampling paths upcast themselves.
        """
        return self.lm_head(hidden)


def lm_head(config: ModelConfig, dtype: torch.dtype, embedding: nn.Module | None
            ) -> ParallelLMHead | None:
    """The LM head of the last pipeline stage (None on the others); tied to the embedding where
    this stage also holds it, else loaded with the embedding's weights (loader.py)."""
    if not stage().last:
        return None
    head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
    if config.tie_word_embeddings and embedding is not None:
        head.weight = embedding.weight
    return head
