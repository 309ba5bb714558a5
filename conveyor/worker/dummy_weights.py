"""Random weights from config.json alone (load_format="dummy"), for shapes too large to save.

Every tensor of the Hugging Face checkpoint the model would load is drawn in full, on the model's
device, from a generator seeded by the engine seed and the tensor's name, and goes through the
same weight loaders as a checkpoint's. Every rank slices its shard out of the same full tensors,
so the weights do not depend on the tensor-parallel size: TP=k can be checked against TP=1.
"""
from __future__ import annotations

import hashlib
import math

import torch

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.models import get_model_class


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """name -> shape of each tensor in a Hugging Face checkpoint of this (Llama-family) model:
    a mixture-of-experts layer has a router (with DeepSeek-V3's correction bias) and each
    expert's projections (and shared experts', with Qwen2-MoE's gate, where it has them) in
    place of the MLP (the model class's make_mlp, built on the meta device, says which layers;
    with the biases of the router and experts where it has them, gpt-oss's), and a family's
    extra tensors come from its `extra_layer_shapes` (Gemma's feed-forward norms; None drops
    one, OLMo's input norm) or its attention options (gpt-oss's sinks; an attention module of
    its own gives its `checkpoint_shapes`), and its tensors outside the layers from its
    `extra_model_shapes` (StarCoder2's final norm bias). Stacked experts appear as the model's
    convert_weights gives them, one a name."""
    from conveyor.worker.layers.moe import FusedMoE

    model_class = get_model_class(config.architecture)
    opts = model_class.attention_options(config)
    extra = getattr(model_class, "extra_layer_shapes", lambda c: {})(config)
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    shapes.update(getattr(model_class, "extra_model_shapes", lambda c: {})(config))
    for i in range(config.num_hidden_layers):
        with torch.device("meta"):
            mlp = model_class.make_mlp(config, i, torch.float32)
        inter = getattr(mlp, "intermediate_size", config.intermediate_size)   # a dense MLP's
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                 "mlp.down_proj.weight": (h, inter)}
        if opts.get("qkv_bias"):
            layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
        if opts.get("o_bias"):
            layer["self_attn.o_proj.bias"] = (h,)
        if opts.get("qk_norm"):                  # each head's, or all heads' (OLMo's)
            every = opts["qk_norm"] == "all"
            layer.update({"self_attn.q_norm.weight": (q,) if every else (d,),
                          "self_attn.k_norm.weight": (kv,) if every else (d,)})
        if opts.get("sinks"):
            layer["self_attn.sinks"] = (config.num_attention_heads,)
        if "module" in opts:                         # an attention of its own (DeepSeek's MLA)
            layer = {k: v for k, v in layer.items() if not k.startswith("self_attn.")}
            layer.update({f"self_attn.{k}": v
                          for k, v in opts["module"].checkpoint_shapes(config).items()})
        moe = getattr(mlp, "experts", None)
        if isinstance(moe, FusedMoE):
            for name in ("gate_proj", "up_proj", "down_proj"):
                del layer[f"mlp.{name}.weight"]
            layer["mlp.gate.weight"] = (moe.num_experts, h)
            for name in ("bias", "e_score_correction_bias"):    # gpt-oss's, GLM's
                if getattr(mlp.gate, name, None) is not None:
                    layer[f"mlp.gate.{name}"] = (moe.num_experts,)
            for e in range(moe.num_experts):
                inter_e = moe.intermediate_size
                layer.update({f"mlp.experts.{e}.gate_proj.weight": (inter_e, h),
                              f"mlp.experts.{e}.up_proj.weight": (inter_e, h),
                              f"mlp.experts.{e}.down_proj.weight": (h, inter_e)})
                if moe.w13_bias is not None:
                    layer.update({f"mlp.experts.{e}.gate_proj.bias": (inter_e,),
                                  f"mlp.experts.{e}.up_proj.bias": (inter_e,),
                                  f"mlp.experts.{e}.down_proj.bias": (h,)})
            for name in ("shared_expert", "shared_experts"):     # Qwen2-MoE's, GLM's
                if (shared := getattr(mlp, name, None)) is not None:
                    s = shared.intermediate_size
                    layer.update({f"mlp.{name}.gate_proj.weight": (s, h),
                                  f"mlp.{name}.up_proj.weight": (s, h),
                                  f"mlp.{name}.down_proj.weight": (h, s)})
            if getattr(mlp, "shared_expert_gate", None) is not None:
                layer["mlp.shared_expert_gate.weight"] = (1, h)
        layer.update(extra)
        layer = {name: shape for name, shape in layer.items() if shape is not None}
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one tensor, the same in every process (unlike hash())."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def dummy_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                  seed: int, mxfp4: bool = False):
    """(name, full tensor) for every checkpoint tensor: normal(0, initializer_range) for
    matrices and biases, 1 + normal(0, initializer_range) for norm weights (as the random
    benchmark models, whose norms are ones, but not all equal). With mxfp4 (experts that took
    FusedMoE.make_mxfp4) each expert's projections come as 4-bit words of random e2m1 codes
    and an e8m0 scale byte `weight_scale` a block of 32, the power of two nearest
    initializer_range / 3 (random codes have an RMS of about 3)."""
    device = torch.device(device)
    std = config.initializer_range
    for name, shape in checkpoint_shapes(config).items():
        gen = torch.Generator(device).manual_seed(tensor_seed(seed, name))
        if mxfp4 and ".mlp.experts." in name and name.endswith("_proj.weight"):
            rows, k = shape
            yield name, torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, k // 8), generator=gen,
                                      dtype=torch.int32, device=device)
            yield name + "_scale", torch.full((rows, k // 32), 127 + round(math.log2(std / 3)),
                                              dtype=torch.uint8, device=device)
            continue
        w = torch.normal(0.0, std, shape, generator=gen, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            w.add_(1)
        yield name, w
