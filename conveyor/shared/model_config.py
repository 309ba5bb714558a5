"""What a model's files say: `ModelConfig`, the architecture in Hugging Face config.json terms
(GGUF metadata is mapped onto it by shared/model_files.py), with the per-layer attention windows
and the quantization a checkpoint declares. No I/O and no torch (the scheduler reads it too);
bad values raise ValueError.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, in Hugging Face config.json terms (GGUF metadata is mapped onto it)."""
    architecture: str                        # e.g. "LlamaForCausalLM"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False             # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False                    # RMSNorm on q and k per head (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    initializer_range: float = 0.02          # std of random (load_format="dummy") weights
    # "fp8" / "int8": the checkpoint stores its linear weights in float8 e4m3 / int8 with scales;
    # "awq" / "gptq" / "w4a16" (compressed-tensors' pack-quantized): 4-bit (GPTQ also 8-bit);
    # "mxfp4": gpt-oss's experts in MXFP4 (config.json's quantization_config;
    # checkpoint_quantization below); None: full precision
    quantization: str | None = None
    # per layer: how many keys (the query's own included) its attention sees; 0 = all of them
    # (Mistral's sliding_window on every layer; Gemma's on the "sliding_attention" layers)
    layer_windows: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)   # config.json as read: family keys

    def window(self, layer: int) -> int:
        """The attention window of `layer` (0: full causal attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] in TEXT_OF_MULTIMODAL:
            cfg = text_part(cfg)
            archs = cfg["architectures"]
        arch = archs[0]
        if cfg.get("model_type") == "exaone":   # transformers saves EXAONE 3.x as Llama
            arch = "ExaoneForCausalLM"
        # config.json's own names for the common keys (EXAONE 3.x's GPT-2 names,
        # InternLM3's biases), where the common one is absent
        cfg = {**{common: cfg[own] for own, common in _KEY_ALIASES.items()
                  if own in cfg and common not in cfg}, **cfg}
        heads = cfg["num_attention_heads"]
        if cfg.get("kv_lora_rank"):
            # DeepSeek's MLA, its keys and values expanded per head (models/deepseek.py): the
            # pool's head is a key's width, and every head has its own
            cfg = {**cfg, "head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
                   "num_key_value_heads": heads}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")   # transformers >= 5 folds theta and scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get(*_NORM_EPS.get(arch, ("rms_norm_eps", 1e-6))),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=(arch.startswith("Qwen2") if cfg.get("attention_bias") is None
                            else bool(cfg["attention_bias"])),
            qk_norm=arch.startswith("Qwen3"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            initializer_range=float(cfg.get("initializer_range") or 0.02),
            quantization=checkpoint_quantization(cfg.get("quantization_config")),
            layer_windows=layer_windows(cfg, arch),
            extra=dict(cfg),
        )


# Multimodal checkpoints served for their text: the language model's architecture, and the
# defaults of its config class (transformers fills what the hub's sparse text_config leaves
# out: Gemma3TextConfig's for gemma-3-4b/12b/27b). The vision tower is not loaded; a request
# with an image is refused (only text content parts are taken).
_GEMMA3_TEXT = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "vocab_size": 262208, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
                "max_position_embeddings": 131072, "sliding_window": 4096,
                "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                "bos_token_id": 2, "eos_token_id": 1}
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", _GEMMA3_TEXT),
                      "Qwen2VLForConditionalGeneration": ("Qwen2ForCausalLM", {}),
                      "Qwen2_5_VLForConditionalGeneration": ("Qwen2ForCausalLM", {}),
                      "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", {}),
                      # transformers' Qwen3-VL-MoE always renormalizes its top-k weights
                      "Qwen3VLMoeForConditionalGeneration": ("Qwen3MoeForCausalLM",
                                                             {"norm_topk_prob": True}),
                      "Mistral3ForConditionalGeneration": ("MistralForCausalLM", {}),
                      "Llama4ForConditionalGeneration": ("Llama4ForCausalLM", {})}
# a multimodal class whose language model varies: its text_config's model_type -> the
# architecture (Mistral 3's is Mistral's, or Mistral Small 4's MLA and experts)
_TEXT_ARCH_BY_TYPE = {"mistral4": "Mistral4ForCausalLM"}
# what a multimodal config says at its top level for the whole model, the text part included
_WHOLE_MODEL_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "quantization_config",
                     "tie_word_embeddings")


def text_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json -> the config of its language model (TEXT_OF_MULTIMODAL): its
    text_config, over the top level's keys (Qwen2-VL's hub configs keep the text model's there)
    and the class's defaults. Qwen2/3-VL's M-RoPE (interleaved or not) is the plain rotation
    for text: a text token has one position in all three of its sections."""
    arch, defaults = TEXT_OF_MULTIMODAL[cfg["architectures"][0]]
    arch = _TEXT_ARCH_BY_TYPE.get((cfg.get("text_config") or {}).get("model_type"), arch)
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text = {**defaults, **top, **(cfg.get("text_config") or {}),
            **{k: cfg[k] for k in _WHOLE_MODEL_KEYS if k in cfg}, "architectures": [arch],
            "text_of": cfg["architectures"][0]}
    if _mrope(text.get("rope_scaling")):
        del text["rope_scaling"]
    if _mrope(text.get("rope_parameters")):         # transformers >= 5: theta kept here
        text["rope_parameters"] = {"rope_type": "default",
                                   **{k: v for k, v in text["rope_parameters"].items()
                                      if k == "rope_theta"}}
    return text


def _mrope(rope: Any) -> bool:
    return isinstance(rope, dict) and ("mrope" in (rope.get("type"), rope.get("rope_type"))
                                       or "mrope_section" in rope)


# a config.json key -> the common key it stands for
_KEY_ALIASES = {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
                "qkv_bias": "attention_bias"}

# the config.json key of the norms' epsilon, and its default, where it is not rms_norm_eps
# (the LayerNorms of Cohere and StarCoder2)
_NORM_EPS = {"CohereForCausalLM": ("layer_norm_eps", 1e-5),
             "Cohere2ForCausalLM": ("layer_norm_eps", 1e-5),
             "Starcoder2ForCausalLM": ("norm_epsilon", 1e-5)}


# Sliding and full attention layers of the families that interleave them, for config.json files
# without `layer_types`: every layer whose (index + 1) is not a multiple of the period slides.
_WINDOW_PERIODS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "GptOssForCausalLM": 2,
                   "Exaone4ForCausalLM": 4, "ExaoneMoeForCausalLM": 4, "Cohere2ForCausalLM": 4}


def layer_windows(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """Each layer's attention window (0: full), from `sliding_window` and `layer_types` (or the
    family's pattern, or Qwen2's and dots.llm1's rule: the layers from `max_window_layers` on
    slide); Qwen2's `use_sliding_window: false` turns the window off."""
    window = cfg.get("sliding_window")
    layers = cfg["num_hidden_layers"]
    if not window or cfg.get("use_sliding_window", True) is False:
        return ()
    types = cfg.get("layer_types")
    if types is None and arch in _WINDOW_PERIODS:
        period = cfg.get("sliding_window_pattern") or _WINDOW_PERIODS[arch]
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                 for i in range(layers)]
    elif types is None and cfg.get("max_window_layers") is not None:
        types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                 for i in range(layers)]
    if types is None:
        return (int(window),) * layers
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


# checkpoints of 4-bit linear weights, loaded into the W4A16 kernels' layout
INT4_FORMATS = ("awq", "gptq", "w4a16")


def checkpoint_quantization(qc: dict[str, Any] | None) -> str | None:
    """The quantization a checkpoint's config.json declares, where conveyor loads it as it is:
    1-byte weights with per-tensor, per-channel or (fp8) square block scales, and 4-bit AWQ and
    GPTQ weights (int4_format), in the formats vLLM calls "fp8"
    (AutoFP8, `quant_method: fp8`) and "compressed-tensors" (llm-compressor's float 8-bit
    weights, or symmetric int 8-bit ones stored as int8: its "int-quantized" W8A8 models, run
    here as W8A16), gpt-oss's "mxfp4" experts (kept in 4 bits, models/gpt_oss.py), and
    bitsandbytes' (8-bit: int8; 4-bit: None, dequantized as it loads). Other formats raise
    ValueError."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":
        return method
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block and (len(block) != 2 or block[0] != block[1]):
            raise ValueError(f"fp8 checkpoints with block-wise scales load with square blocks "
                             f"(weight_block_size [B, B]), got {block}")
        return "fp8"
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        kinds = {w.get("type") for w in weights}
        if _format(qc) == "pack-quantized":
            int4_format(qc)
            return "w4a16"
        if (len(kinds) == 1 and all(w.get("num_bits") == 8 and w.get("symmetric", True)
                                    and w.get("strategy") in ("tensor", "channel", "block")
                                    for w in weights)
                and (kinds == {"float"} or qc.get("format") == "int-quantized")
                and all(w.get("strategy") != "block" or (
                    kinds == {"float"} and len(w.get("block_structure") or []) == 2
                    and len(set(w["block_structure"])) == 1) for w in weights)):
            return "fp8" if kinds == {"float"} else "int8"
        raise ValueError("of compressed-tensors checkpoints, conveyor loads 8-bit weights with "
                         "tensor, channel or (float, square) block scales only: float, or "
                         "symmetric int stored as int8 (format int-quantized); and 4-bit int "
                         "weights packed in int32 (format pack-quantized, W4A16)")
    if method in ("awq", "gptq"):
        int4_format(qc)
        return method
    if method == "bitsandbytes":        # worker/bnb_checkpoint.py: 4-bit is dequantized at load
        if qc.get("load_in_8bit") or qc.get("load_in_4bit"):
            return "int8" if qc.get("load_in_8bit") else None
        raise ValueError("a bitsandbytes checkpoint's quantization_config says neither "
                         "load_in_8bit nor load_in_4bit")
    raise ValueError(f"checkpoint quantization {method!r} is not supported (conveyor loads fp8, "
                     f"int8, AWQ, GPTQ, bitsandbytes and gpt-oss's mxfp4 checkpoints, and "
                     f"quantizes full-precision ones with --quantization)")


def _format(qc: dict[str, Any]) -> str | None:
    """A compressed-tensors config's format: the top level's, else its groups' (one)."""
    formats = {g.get("format") for g in (qc.get("config_groups") or {}).values()} - {None}
    return qc.get("format") or (formats.pop() if len(formats) == 1 else None)


def int4_format(qc: dict[str, Any]) -> tuple[int, int, bool]:
    """An AWQ, GPTQ or compressed-tensors pack-quantized quantization_config -> (group size, 0
    for the whole row; the zero offset, 1 for GPTQ's "gptq" format, which stores zero - 1;
    act-order). Refuses what conveyor does not load: other bit widths (8-bit GPTQ loads,
    symmetric and in order: `gptq_bits`), AWQ other than its GEMM layout with zero points,
    compressed-tensors' other schemes."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _pack_quantized(qc)
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4 and not (method == "gptq" and bits == 8):
        raise ValueError(f"{method} checkpoints load with 4-bit weights (GPTQ: or 8-bit), got "
                         f"bits {bits}")
    if bits == 8 and (qc.get("desc_act") or not qc.get("sym", True)):
        raise ValueError("8-bit GPTQ checkpoints load symmetric (sym) without act-order "
                         "(desc_act) only: their layers run as int8 with one scale a group, no "
                         "zero point nor column order")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm" or not qc.get("zero_point", True):
            raise ValueError("AWQ checkpoints load in the GEMM layout with zero points only, "
                             f"got version {qc.get('version')!r}, zero_point "
                             f"{qc.get('zero_point')!r}")
        return (0 if group == -1 else group), 0, False
    offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    return (0 if group == -1 else group), offset, bool(qc.get("desc_act"))


def _pack_quantized(qc: dict[str, Any]) -> tuple[int, int, bool]:
    """compressed-tensors' pack-quantized W4A16 (llm-compressor's GPTQ and AWQ output, as the
    "quantized.w4a16" releases): 4-bit int weights, one scheme for every quantized layer, by
    group or channel, symmetric or not, act-order "group" (a g_idx) or "weight" (none), no
    activation quantization. Stored values are q + 8, so the zero offset is 0: a symmetric
    layer's zero is 8 (worker/int4_checkpoint.py)."""
    groups = list((qc.get("config_groups") or {}).values())
    schemes = {json.dumps(g.get("weights"), sort_keys=True) for g in groups}
    w = (groups[0].get("weights") or {}) if groups else {}
    problems = [text for bad, text in (
        (len(schemes) != 1, f"one weight scheme (got {len(schemes)})"),
        (w.get("type") != "int" or w.get("num_bits") != 4,
         f"4-bit int weights (got {w.get('num_bits')}-bit {w.get('type')})"),
        (w.get("strategy") not in ("group", "channel"),
         f"group or channel scales (got {w.get('strategy')})"),
        (bool(w.get("dynamic")), "static weight scales"),
        (any(g.get("input_activations") for g in groups), "no activation quantization (W4A16)"),
        (w.get("actorder") not in (None, "group", "weight", "static"),
         f"act-order group or weight (got {w.get('actorder')})")) if bad]
    if problems:
        raise ValueError("compressed-tensors pack-quantized checkpoints load with "
                         + "; ".join(problems))
    group = (w.get("group_size") or 0) if w.get("strategy") == "group" else 0
    return group, 0, w.get("actorder") == "group"


def gptq_bits(qc: dict[str, Any]) -> int:
    """The width of a 4-bit format's values: 8 for an 8-bit GPTQ checkpoint (Qwen's
    GPTQ-Int8 releases), which loads as int8 weights with group scales; else 4."""
    return 8 if qc.get("quant_method") == "gptq" and qc.get("bits") == 8 else 4
