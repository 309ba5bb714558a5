"""Tiny random Hugging Face models, saved as real folders, for comparing conveyor against
transformers without downloading anything.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
               max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2,
               bos_token_id=1, eos_token_id=2)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}

PRESETS = {
    # name: (config class name, config arguments beyond _COMMON)
    "llama": ("LlamaConfig", {"rope_parameters": _LLAMA3_ROPE, "tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False, "rope_theta": 1e6}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 8, "tie_word_embeddings": False}),
    # Ministral: Mistral's window on the layers layer_types says slide (0 and 2 of 3)
    "ministral": ("MinistralConfig", {"sliding_window": 8, "tie_word_embeddings": False,
                                      "num_hidden_layers": 3,
                                      "layer_types": ["sliding_attention", "full_attention",
                                                      "sliding_attention"]}),
    # Ministral 3: YaRN, queries scaled by 1 + 0.1 log(1 + floor(position / 4)) (a trained
    # context of 4 positions, so that the tiny prompts pass several multiples of it)
    "ministral3": ("Ministral3Config", {"tie_word_embeddings": False, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.1}}),
    # EXAONE 3.x: Llama under GPT-2's names (transformers saves them so); InternLM3: Llama
    "exaone": ("ExaoneConfig", {"eos_token_id": 2, "tie_word_embeddings": False}),
    "internlm3": ("InternLM3Config", {"pad_token_id": 0, "tie_word_embeddings": False}),
    # Llama 4: layers 0-2 rotate (interleaved pairs), attend within chunks of 8 and norm q/k
    # without a weight; layer 3 sees everything, its queries scaled by position (floor_scale
    # 4); layers 1 and 3 hold 4 experts of width 24 (top 1, weighting their input) beside a
    # shared one, layers 0 and 2 a dense MLP of 40
    "llama4": ("Llama4TextConfig", {
        "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
        "intermediate_size": 24, "intermediate_size_mlp": 40, "interleave_moe_layer_step": 2,
        "attention_chunk_size": 8, "floor_scale": 4, "attn_scale": 0.1, "pad_token_id": 0,
        "tie_word_embeddings": False}),
    # layers 1 and 3 of 4 without rotary embedding (NoPE)
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 4, "no_rope_layer_interval": 2,
                                  "pad_token_id": 0, "tie_word_embeddings": True}),
    # Gemma 1: (1 + w) norms, GELU gate, scaled embeddings, two norms a layer
    "gemma": ("GemmaConfig", {"pad_token_id": 0, "tie_word_embeddings": True}),
    # every other layer slides (window 8); soft-capped attention and final logits
    "gemma2": ("Gemma2Config", {"sliding_window": 8, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0,
                                "num_hidden_layers": 3}),
    # layers 0-1 slide with the local rope base, layer 2 global with linear rope scaling
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 8, "sliding_window_pattern": 3,
                                    "num_hidden_layers": 3, "query_pre_attn_scalar": 16,
                                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # LongRoPE (short factors below position 64, long from there) over half of each head
    "phi3": ("Phi3Config", {"max_position_embeddings": 256, "original_max_position_embeddings": 64,
                            "partial_rotary_factor": 0.5, "tie_word_embeddings": False,
                            "pad_token_id": 0,
                            "rope_scaling": {"type": "longrope",
                                             "short_factor": [1.0, 1.3, 1.7, 2.5],
                                             "long_factor": [2.0, 3.1, 4.7, 9.0]}}),
    # 6 experts of width 24, 2 a token, renormalised; layer 1 of 3 dense (mlp_only_layers)
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 24, "norm_topk_prob": True,
                                     "num_hidden_layers": 3, "mlp_only_layers": [1],
                                     "tie_word_embeddings": False}),
    "qwen3-moe-unnormed": ("Qwen3MoeConfig", {"num_experts": 5, "num_experts_per_tok": 3,
                                              "moe_intermediate_size": 24,
                                              "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": 8, "intermediate_size": 40}),
    # 6 experts of width 24, 2 a token, not renormalised, and a gated shared expert of width 40;
    # layer 1 of 3 dense (mlp_only_layers)
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 24,
                                     "shared_expert_intermediate_size": 40,
                                     "norm_topk_prob": False, "num_hidden_layers": 3,
                                     "mlp_only_layers": [1], "tie_word_embeddings": False}),
    # 8 experts of width 24 in 4 groups, the best 2 groups eligible, 3 experts a token, scaled
    # by 2.5; 2 shared experts; layer 0 of 3 dense; q/k norms, rotary over half of each head
    "glm4-moe": ("Glm4MoeConfig", {"n_routed_experts": 8, "num_experts_per_tok": 3,
                                   "n_group": 4, "topk_group": 2, "moe_intermediate_size": 24,
                                   "n_shared_experts": 2, "first_k_dense_replace": 1,
                                   "routed_scaling_factor": 2.5, "num_hidden_layers": 3,
                                   "attention_bias": True, "use_qk_norm": True,
                                   "tie_word_embeddings": False}),
    # GLM-4-0414: four norms a layer, q/k/v bias, half of each head rotated in interleaved pairs
    "glm4": ("Glm4Config", {"partial_rotary_factor": 0.5, "attention_bias": True, "pad_token_id": 0,
                            "tie_word_embeddings": False}),
    "glm": ("GlmConfig", {"partial_rotary_factor": 0.5, "attention_bias": True, "pad_token_id": 0,
                          "tie_word_embeddings": False}),
    # MLA (q through a rank-48 latent, kv through rank 32; 16 + 8 rotary features a key, values
    # of 12), YaRN with mscale_all_dim; 8 experts in 4 groups as GLM's, 1 shared; layer 0 dense
    "deepseek-v3": ("DeepseekV3Config", {
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "head_dim": 8, "num_key_value_heads": 4,
        "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
        "topk_group": 2, "moe_intermediate_size": 24, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "num_hidden_layers": 3,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 32, "mscale": 0.7,
                            "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}}),
    # GLM-4.7-Flash: V3's MLA and router, the dense layers listed (mlp_layer_types: 0 and 2
    # of 3), the rotary halves not interleaved (published configs interleave, as V3's)
    "glm4-moe-lite": ("Glm4MoeLiteConfig", {
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "num_key_value_heads": 4, "v_head_dim": 12, "n_routed_experts": 8,
        "num_experts_per_tok": 3, "moe_intermediate_size": 24, "n_shared_experts": 1,
        "routed_scaling_factor": 1.8, "num_hidden_layers": 3, "rope_interleave": False,
        "mlp_layer_types": ["dense", "sparse", "dense"]}),
    # dots.llm1: Qwen3's attention, V3's experts after one dense layer (8 of width 24, 3 a
    # token from the best 2 of 4 groups, a shared one); layer 2 slides (max_window_layers)
    "dots1": ("Dots1Config", {
        "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
        "moe_intermediate_size": 24, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.0, "num_hidden_layers": 3,
        "sliding_window": 8, "max_window_layers": 2, "tie_word_embeddings": False}),
    # K-EXAONE: EXAONE 4's attention (layers 0-2 slide with the rotary embedding, 3 is full
    # without) in Llama's decoder; after one dense layer V3's experts (8 of width 24, 3 a
    # token from the best 2 of 4 groups, a shared one)
    "exaone-moe": ("ExaoneMoeConfig", {
        "num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 4,
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
        "num_shared_experts": 1, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "eos_token_id": 2, "tie_word_embeddings": False}),
    # MLA without the q latent; softmax router over the best 2 of 4 groups by their best
    # expert, not renormalised, scaled by 1.5; 2 shared experts
    "deepseek-v2": ("DeepseekV2Config", {
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "head_dim": 8, "num_key_value_heads": 4,
        "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
        "topk_group": 2, "topk_method": "group_limited_greedy", "moe_intermediate_size": 24,
        "n_shared_experts": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 1.5,
        "num_hidden_layers": 3}),
    # norms after the sublayers, q/k norms over all heads
    "olmo2": ("Olmo2Config", {"tie_word_embeddings": False, "num_hidden_layers": 3}),
    # OLMo 3: three sliding layers (window 8) of four; YaRN on the full layer only
    "olmo3": ("Olmo3Config", {"sliding_window": 8, "num_hidden_layers": 4,
                              "tie_word_embeddings": False,
                              "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32,
                                               "beta_fast": 32.0, "beta_slow": 1.0}}),
    # OLMo 2's decoder with per-head q/k norms; layers 0-2 slide (window 8) with the rotary
    # embedding, layer 3 sees everything without it
    "exaone4": ("Exaone4Config", {"sliding_window": 8, "sliding_window_pattern": 4,
                                  "num_hidden_layers": 4, "tie_word_embeddings": False}),
    # biases on q, k, v and (apart) on o
    "seed-oss": ("SeedOssConfig", {"attention_bias": True, "attention_out_bias": True,
                                   "tie_word_embeddings": False}),
    # Granite's four multipliers, each far from 1 (and the embedding tied to the head)
    "granite": ("GraniteConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                  "attention_multiplier": 0.0156, "logits_scaling": 8.0,
                                  "tie_word_embeddings": True}),
    # parallel attention and MLP after one LayerNorm, interleaved rotary pairs, logits scaled;
    # Cohere2: layers 0-2 and 4-6 slide (window 8) with the rotary embedding, 3 and 7 without
    "cohere": ("CohereConfig", {"logit_scale": 0.5, "layer_norm_eps": 1e-5, "bos_token_id": 5,
                                "eos_token_id": 2, "pad_token_id": 0}),
    "cohere2": ("Cohere2Config", {"logit_scale": 0.5, "layer_norm_eps": 1e-5, "sliding_window": 8,
                                  "num_hidden_layers": 8, "bos_token_id": 5, "eos_token_id": 2,
                                  "pad_token_id": 0}),
    # q/k norms over all heads, rotary over 8 of 16 features (the checkpoint's rotary_dim);
    # 8 experts of width 24, 3 a token, by sigmoid scores with a correction bias
    # (the factor given too: transformers before 5.25 ignores rotary_dim and rotated all 16)
    "minimax-m2": ("MiniMaxM2Config", {"num_local_experts": 8, "num_experts_per_tok": 3,
                                       "intermediate_size": 24, "rotary_dim": 8,
                                       "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 5e6,
                                                           "partial_rotary_factor": 0.5},
                                       "tie_word_embeddings": False}),
    # interleaved rotary pairs; the MoE variant: layers 1 and 2 of 3 with 6 experts of width
    # 24, 2 a token, by softmax scores with a correction bias, and one shared expert
    "ernie4.5": ("Ernie4_5Config", {"tie_word_embeddings": True}),
    "ernie4.5-moe": ("Ernie4_5_MoeConfig", {
        "moe_num_experts": 6, "moe_k": 2, "moe_intermediate_size": 24,
        "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "num_hidden_layers": 3,
        "tie_word_embeddings": False}),
    # q/k norms over all heads; 6 experts of width 24, 2 a token (OLMoE: not renormalised;
    # FlexOlmo: renormalised, OLMo 2's norms after the sublayers)
    "olmoe": ("OlmoeConfig", {"num_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 24,
                              "norm_topk_prob": False, "pad_token_id": 0,
                              "tie_word_embeddings": False}),
    "flex-olmo": ("FlexOlmoConfig", {"num_experts": 6, "num_experts_per_tok": 2,
                                     "intermediate_size": 24, "norm_topk_prob": True,
                                     "pad_token_id": 0, "tie_word_embeddings": False}),
    # q/k norms after the rotary embedding, whose base NTK alpha stretches
    "hunyuan": ("HunYuanDenseV1Config", {"rope_scaling": {"type": "dynamic", "alpha": 1000.0,
                                                           "factor": 1.0},
                                         "pad_token_id": 0, "tie_word_embeddings": True}),
    # Hunyuan's attention; 6 experts of width 24 (intermediate_size: transformers' reading),
    # 2, 3, 2 a token by layer, beside one shared MLP; a float32 router
    "hunyuan-moe": ("HunYuanMoEV1Config", {
        "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}, "num_experts": 6,
        "moe_topk": [2, 3, 2], "intermediate_size": 24, "num_hidden_layers": 3,
        "pad_token_id": 0, "tie_word_embeddings": False}),
    # LayerNorms with biases, biases everywhere, an ungated GELU MLP, a window of 8 on every
    # layer
    "starcoder2": ("Starcoder2Config", {"norm_epsilon": 1e-5, "use_bias": True,
                                        "sliding_window": 8, "hidden_act": "gelu_pytorch_tanh",
                                        "tie_word_embeddings": True}),
    # MLPs without a gate: ReLU squared (Arcee); xIELU with per-head q/k norms (Apertus)
    "arcee": ("ArceeConfig", {"pad_token_id": 0, "tie_word_embeddings": False}),
    "apertus": ("ApertusConfig", {"pad_token_id": 0, "tie_word_embeddings": False}),
    # Granite's multipliers; 6 experts of width 24, 2 a token; the shared variant with an
    # ungated shared expert of width 40
    "granite-moe": ("GraniteMoeConfig", {
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0156,
        "logits_scaling": 8.0, "num_local_experts": 6, "num_experts_per_tok": 2,
        "intermediate_size": 24, "tie_word_embeddings": False}),
    "granite-moe-shared": ("GraniteMoeSharedConfig", {
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0156,
        "logits_scaling": 8.0, "num_local_experts": 5, "num_experts_per_tok": 3,
        "intermediate_size": 24, "shared_intermediate_size": 40, "tie_word_embeddings": True}),
    # layers 0 and 2 slide (window 8), 1 and 3 see everything; attention sinks; YaRN (32
    # positions stretched 4 times); 4 experts of width 32 with biases, 2 a token, the clamped
    # SwiGLU (a limit of 1.5, so that it clamps often)
    "gpt-oss": ("GptOssConfig", {"num_hidden_layers": 4, "sliding_window": 8,
                                 "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "intermediate_size": 32, "swiglu_limit": 1.5,
                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0,
                                                     "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 32}}),
}


def make_tiny_model(arch: str, path, seed: int = 0, weights: bool = True, **overrides) -> Path:
    """Save a random float32 model of preset `arch` (see PRESETS) into the folder `path`; with
    weights=False only its config.json (for load_format="dummy").

    `overrides` replace config arguments, e.g. num_hidden_layers=1.
    """
    import transformers

    if arch not in PRESETS:
        raise ValueError(f"unknown tiny model {arch!r} (known: {', '.join(PRESETS)})")
    config_class, extra = PRESETS[arch]
    config_cls = getattr(transformers, config_class)
    if "swiglu_limit" in extra and "swiglu_limit" not in getattr(config_cls, "__annotations__", {}):
        # older transformers (5.17) fix gpt-oss's limit at 7.0 whatever the config says
        extra = {k: v for k, v in extra.items() if k != "swiglu_limit"}
    config = config_cls(**{**_COMMON, **extra, **overrides})
    if not weights:
        config.architectures = [config_class.replace("TextConfig", "Config")
                                .replace("Config", "ForCausalLM")]
        config.save_pretrained(path)
        return Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():   # HF initialises norms to ones and biases to zeros: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("sinks"):       # gpt-oss's: large enough to take a share
                p.copy_(torch.randn_like(p) + 1.5)
            if name.endswith("e_score_correction_bias"):   # ERNIE's, a parameter: as GLM's
                p.copy_(torch.randn_like(p) * 0.5)
        for name, b in model.named_buffers():   # GLM's router bias: big enough to sway it
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
            # NOTE: transformers keeps DeepSeek's and GLM's routers in float32 but, loading in
            # bf16, with bf16-rounded values; published checkpoints store them in bf16, so
            # rounding here makes a bf16 reference route as ours does (near-ties flipped
            # otherwise: the GPU family test of glm4-moe failed on it)
            if name.endswith("e_score_correction_bias"):   # beside the router (MiniMax-M2)
                owner = model.get_submodule(name.rsplit(".", 1)[0])
                gate = owner.gate.weight if hasattr(owner, "gate") else owner.weight
                gate.copy_(gate.to(torch.bfloat16).float())
    path = Path(path)
    model.save_pretrained(path)
    return path


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def make_tiny_gguf(path, quant: str = "Q8_0", seed: int = 0, **overrides) -> Path:
    """Save the tiny random "llama" preset as a GGUF file at `path`, its 2-D weights quantized
    with gguf.quants (`quant`: a GGMLQuantizationType name), norms float32. q/k rows are
    permuted as llama.cpp's converter does. Returns (path, the transformers model)."""
    import gguf
    import transformers

    config_class, extra = PRESETS["llama"]
    config = getattr(transformers, config_class)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    c = config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    kind = gguf.GGMLQuantizationType[quant]

    def add(name, w: torch.Tensor, heads: int | None = None):
        w = w.detach().float()
        if heads is not None:             # llama.cpp: per head, two halves -> interleaved pairs
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape)
        array = w.numpy()
        if array.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)

    add("token_embd.weight", model.model.embed_tokens.weight)
    add("output_norm.weight", model.model.norm.weight)
    add("output.weight", model.lm_head.weight)
    for i, layer in enumerate(model.model.layers):
        for hf, ours in _GGUF_NAMES.items():
            w = layer.get_submodule(hf).weight
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(ours)
            add(f"blk.{i}.{ours}.weight", w, heads)
    return _finish_gguf(writer, path)


def _finish_gguf(writer, path, src: Path | None = None, ref=None, held: dict | None = None
                 ) -> Path:
    """Write and close the GGUF at `path`; with `ref`, a folder of the model `src`'s config and
    the weights the file holds (`held`, dequantized), for transformers to run."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if ref is not None:
        from safetensors.torch import save_file

        ref = Path(ref)
        ref.mkdir(parents=True)
        shutil.copy(Path(src) / "config.json", ref)
        save_file({k: v.contiguous() for k, v in held.items()}, ref / "model.safetensors")
    return Path(path)


_GGUF_MOE = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "gate": "ffn_gate_inp"}
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w1": "ffn_gate_exps", "w3": "ffn_up_exps",
                 "w2": "ffn_down_exps"}


def make_tiny_moe_gguf(arch: str, path, ref, quant: str = "Q8_0", **overrides) -> Path:
    """Save the tiny random "qwen3-moe" or "mixtral" preset as a GGUF file at `path` the way
    llama.cpp converts them (arch "qwen3moe", or "llama" with experts for Mixtral; each layer's
    experts stacked into blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, out, in]), 2-D
    and 3-D weights quantized to `quant`, the router and norms float32; and into the folder
    `ref` the same model with the dequantized weights, for transformers to run as the
    reference. Every layer is a mixture (no mlp_only_layers)."""
    import gguf
    from safetensors.torch import load_file

    src = make_tiny_model(arch, Path(ref).with_suffix(".src"), **overrides)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    gguf_arch = "qwen3moe" if arch == "qwen3-moe" else "llama"
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    experts = config.get("num_experts") or config["num_local_experts"]
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if gguf_arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    kind = gguf.GGMLQuantizationType[quant]
    dequantized = dict(tensors)

    def add(name, w: torch.Tensor, hf_names, num_heads=None, quantize=True):
        array = w.float().numpy()
        if quantize and array.ndim >= 2:
            packed = gguf.quants.quantize(array, kind)
            deq = torch.from_numpy(gguf.quants.dequantize(packed, kind).copy())
            for i, hf in enumerate(hf_names):     # a stack: one expert each
                dequantized[hf] = deq[i] if len(hf_names) > 1 else deq
            if num_heads is not None and gguf_arch == "llama":     # llama.cpp's q/k order
                w = w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, -1).transpose(1, 2)
                packed = gguf.quants.quantize(w.reshape(array.shape).float().numpy(), kind)
            writer.add_tensor(name, packed, raw_dtype=kind)
        else:
            writer.add_tensor(name, array)

    add("token_embd.weight", tensors["model.embed_tokens.weight"], ["model.embed_tokens.weight"])
    add("output_norm.weight", tensors["model.norm.weight"], [])
    if "lm_head.weight" in tensors:
        add("output.weight", tensors["lm_head.weight"], ["lm_head.weight"])
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for name, t in tensors.items():
            if not name.startswith(prefix) or ".experts." in name:
                continue
            module = name.removeprefix(prefix).rsplit(".", 1)[0].split(".")[-1]
            ours = _GGUF_MOE[module]
            add(f"blk.{i}.{ours}.weight", t, [name],
                {"attn_q": heads, "attn_k": kv_heads}.get(ours), quantize=ours != "ffn_gate_inp")
        for proj in sorted({n.split(".")[-2] for n in tensors if n.startswith(prefix + "")
                            and ".experts." in n}):
            names = [n for e in range(experts) for n in tensors
                     if n.startswith(f"{prefix}") and f".experts.{e}.{proj}.weight" in n]
            add(f"blk.{i}.{_GGUF_EXPERTS[proj]}.weight",
                torch.stack([tensors[n] for n in names]), names)
    return _finish_gguf(writer, path, src, ref, dequantized)


# Gemma's sliding-window period and the 27B sizes (by layers) that llama.cpp fixes per arch
_GGUF_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _refuse_what_gguf_cannot_carry(arch: str, c: dict) -> None:
    """ValueError for a config that llama.cpp's GGUF of `arch` cannot hold (llama.cpp would run
    a different model): Gemma's query_pre_attn_scalar (derived from the size), its window period
    and Gemma 2's rope base and Gemma 3's local one (fixed); gpt-oss's SwiGLU and its
    alternating layers, the first sliding (fixed)."""
    if arch == "phi3":
        return
    if arch == "gpt-oss":
        types = ["full_attention" if i % 2 else "sliding_attention"
                 for i in range(c["num_hidden_layers"])]
        wrong = {"swiglu": ((c["swiglu_alpha"], c["swiglu_limit"]), (1.702, 7.0)),
                 "layer_types": (c["layer_types"], types)}
        wrong = {k: v for k, v in wrong.items() if v[0] != v[1]}
        if wrong:
            raise ValueError(f"llama.cpp's gpt-oss GGUF cannot carry {wrong} (as (given, "
                             f"llama.cpp's))")
        return
    layers, rope = c["num_hidden_layers"], c.get("rope_parameters") or {}
    big = layers == _GGUF_GEMMA_27B_LAYERS[arch]
    scalar = c["hidden_size"] // c["num_attention_heads"] if big else c["head_dim"]
    period = _GGUF_SWA_PERIOD[arch]
    types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
             for i in range(layers)]
    local = rope.get("sliding_attention", rope) if arch == "gemma3" else rope
    wrong = {"query_pre_attn_scalar": (c["query_pre_attn_scalar"], scalar),
             "layer_types": (c["layer_types"], types),
             "sliding layers' rope": ((local.get("rope_theta"), local.get("rope_type", "default")),
                            (10000.0, "default"))}
    wrong = {k: v for k, v in wrong.items() if v[0] != v[1]}
    if wrong:
        raise ValueError(f"llama.cpp's {arch} GGUF cannot carry {wrong} (as (given, llama.cpp's))")


def _write_family_keys(writer, arch: str, c: dict) -> None:
    """The metadata keys convert_hf_to_gguf.py writes for `arch` (Gemma2Model.set_gguf_parameters;
    Gemma3Model's over TextModel's; Phi3MiniModel's; GptOssModel's over TextModel's), and the
    tokenizer's token list and ids."""
    import math

    import gguf
    import numpy as np

    rope = c.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if arch != "phi3":                       # head_dim apart from hidden / heads
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        writer.add_sliding_window(c["sliding_window"])
    elif arch == "gemma3":
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_freq_base(rope["rope_theta"])
        if c.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        if c.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(c["sliding_window"])
    elif arch == "gpt-oss":
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_expert_count(c["num_local_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_sliding_window(c["sliding_window"])
        writer.add_expert_feed_forward_length(c["intermediate_size"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    else:
        heads = c["num_attention_heads"]
        rotary = int(rope.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // heads
        orig = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(orig)
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(c.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = c["max_position_embeddings"] / orig
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
            for kind in ("long", "short"):
                writer.add_tensor(f"rope_factors_{kind}.weight",
                                  np.array(rope[f"{kind}_factor"], dtype=np.float32))
    writer.add_token_list([f"<t{i}>" for i in range(c["vocab_size"])])
    writer.add_bos_token_id(c["bos_token_id"])
    writer.add_eos_token_id(c["eos_token_id"])


def make_tiny_family_gguf(arch: str, path, ref, quant: str = "Q8_0", **overrides) -> Path:
    """Save the tiny random "gemma2", "gemma3" or "phi3" preset as a GGUF file at `path` the
    way llama.cpp's convert_hf_to_gguf.py writes it: gguf-py's tensor names (TensorNameMap),
    Gemma's norms stored as 1 + w, Phi-3's qkv_proj and gate_up_proj kept fused (attn_qkv,
    ffn_up) and its LongRoPE factors as tensors, no q/k permutation (these archs rotate halves),
    the converter's metadata keys; 2-D weights in `quant` (F32, F16 or Q8_0), 1-D ones in F32.
    Into the folder `ref` goes the same model with the weights the file holds (dequantized), for
    transformers to run as the reference. A config llama.cpp's GGUF cannot carry raises
    ValueError."""
    import gguf
    from safetensors.torch import load_file

    src = make_tiny_model(arch, Path(ref).with_suffix(".src"), **overrides)
    config = json.loads((src / "config.json").read_text())
    _refuse_what_gguf_cannot_carry(arch, config)
    tensors = load_file(src / "model.safetensors")
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch],
                                     config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    _write_family_keys(writer, arch, config)
    kind = gguf.GGMLQuantizationType[quant]
    held = {}
    for name, w in tensors.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        array = w.float().numpy()
        if array.ndim == 1:
            plus_one = arch != "phi3" and name.endswith("norm.weight")
            writer.add_tensor(gguf_name, array + 1 if plus_one else array)
            held[name] = w
        else:
            packed = gguf.quants.quantize(array, kind)
            writer.add_tensor(gguf_name, packed, raw_dtype=kind)
            held[name] = torch.from_numpy(gguf.quants.dequantize(packed, kind).copy())
    return _finish_gguf(writer, path, src, ref, held)


def make_tiny_gpt_oss_gguf(path, ref, quant: str = "F16", experts: str = "MXFP4",
                           **overrides) -> Path:
    """Save the tiny random "gpt-oss" preset as a GGUF file at `path` the way llama.cpp's
    convert_hf_to_gguf.py (GptOssModel) writes it: each layer's experts as stacks [E, out, in]
    (gate_up_proj transposed and its interleaved rows split into ffn_gate_exps and ffn_up_exps,
    its bias likewise) in `experts` (MXFP4: gguf's own quantization), the sinks as
    attn_sinks.weight, the other 2-D weights in `quant` but the router, which stays F32 with the
    biases and norms; the converter's metadata keys. Into the folder `ref` goes the same model
    with the weights the file holds (dequantized by gguf), for transformers to run as the
    reference. A config llama.cpp's GGUF cannot carry raises ValueError."""
    import gguf
    from safetensors.torch import load_file

    src = make_tiny_model("gpt-oss", Path(ref).with_suffix(".src"), **overrides)
    config = json.loads((src / "config.json").read_text())
    _refuse_what_gguf_cannot_carry("gpt-oss", config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    _write_family_keys(writer, "gpt-oss", config)
    f32, dense, stacked = (gguf.GGMLQuantizationType[k] for k in ("F32", quant, experts))

    def add(hf_name: str, w: torch.Tensor, kind) -> torch.Tensor:
        """Write w under hf_name's GGUF name in `kind`; returns what the file holds."""
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if kind == f32:
            writer.add_tensor(gguf_name, w.float().numpy())
            return w
        packed = gguf.quants.quantize(w.float().contiguous().numpy(), kind)
        writer.add_tensor(gguf_name, packed, raw_dtype=kind)
        return torch.from_numpy(gguf.quants.dequantize(packed, kind).copy())

    held = {}
    for name, w in load_file(src / "model.safetensors").items():
        prefix = name.rsplit(".", 1)[0]                       # model.layers.N.mlp.experts
        if name.endswith(".experts.gate_up_proj"):            # [E, H, 2I]: gate, up, gate, ...
            rows = w.transpose(1, 2)
            gate = add(prefix + ".gate_proj.weight", rows[:, 0::2], stacked)
            up = add(prefix + ".up_proj.weight", rows[:, 1::2], stacked)
            held[name] = torch.stack([gate, up], 2).flatten(1, 2).transpose(1, 2)
        elif name.endswith(".experts.gate_up_proj_bias"):     # [E, 2I]
            gate = add(prefix + ".gate_proj.bias", w[:, 0::2], f32)
            up = add(prefix + ".up_proj.bias", w[:, 1::2], f32)
            held[name] = torch.stack([gate, up], 2).flatten(1)
        elif name.endswith(".experts.down_proj"):             # [E, I, H]
            held[name] = add(prefix + ".down_proj.weight", w.transpose(1, 2), stacked
                             ).transpose(1, 2)
        elif name.endswith(".experts.down_proj_bias"):
            held[name] = add(prefix + ".down_proj.bias", w, f32)
        elif name.endswith(".sinks"):                         # the converter adds ".weight"
            held[name] = add(name + ".weight", w, f32)
        else:
            full = w.dim() == 1 or ".mlp.router." in name
            held[name] = add(name, w, f32 if full else dense)
    return _finish_gguf(writer, path, src, ref, held)


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_tiny_adapter(base, path, seed: int = 0, r: int = 8, alpha: float = 16,
                      targets=ALL_PROJECTIONS, use_rslora: bool = False, std: float = 0.1) -> Path:
    """Save a PEFT LoRA adapter for the model folder `base` into `path`: random A and B (peft
    starts B at zero, which would change nothing), made and saved by peft itself."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                        use_rslora=use_rslora, lora_dropout=0.0, bias="none")
    model = get_peft_model(base_model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn_like(p) * std)
    path = Path(path)
    model.save_pretrained(path)
    return path


def peft_model(base, adapter):
    """transformers + peft: the base model folder with the adapter folder applied, eval mode."""
    import transformers
    from peft import PeftModel

    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(base_model, adapter).eval()


# Mistral 3's vision tower (Pixtral), the same for each of its text models
_PIXTRAL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14, head_dim=16)
# tiny multimodal models by transformers: model_type (":" and the text model's where one
# class takes several) -> (text_config, vision_config, other keys, the text architecture
# conveyor serves)
MULTIMODAL = {
    "gemma3": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=512,
                    sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=16,
                    rope_scaling={"rope_type": "linear", "factor": 2.0}),
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, image_size=28, patch_size=14),
               dict(mm_tokens_per_image=4, image_token_index=500, boi_token_index=501,
                    eoi_token_index=502), "Gemma3ForCausalLM"),
    "qwen2_5_vl": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                        bos_token_id=1, eos_token_id=2,
                        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                        out_hidden_size=64, fullatt_block_indexes=[0]),
                   dict(image_token_id=500, video_token_id=501, vision_start_token_id=502),
                   "Qwen2ForCausalLM"),
    "qwen3_vl": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                      bos_token_id=1, eos_token_id=2,
                      rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                                    "mrope_interleaved": True}),
                 dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64, deepstack_visual_indexes=[]),
                 dict(image_token_id=500, video_token_id=501, vision_start_token_id=502),
                 "Qwen3ForCausalLM"),
    "mistral3": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                      bos_token_id=1, eos_token_id=2, sliding_window=8),
                 _PIXTRAL, dict(image_token_index=500), "MistralForCausalLM"),
    # Ministral 3 (3B/8B/14B, Devstral 2): Mistral 3's text_config of model_type ministral3,
    # YaRN and the queries' scale by position (a trained context of 4 positions here)
    "mistral3:ministral3": (
        dict(model_type="ministral3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             bos_token_id=1, eos_token_id=2,
             rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                              "beta_fast": 32.0, "beta_slow": 1.0,
                              "original_max_position_embeddings": 4,
                              "llama_4_scaling_beta": 0.1}),
        _PIXTRAL, dict(image_token_index=500), "MistralForCausalLM"),
    # Llama 4 (Scout, Maverick): the tiny text model of models_util's "llama4" preset
    "llama4": (
        dict(hidden_size=64, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
             attention_chunk_size=8, floor_scale=4, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, initializer_range=0.2),
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
             projector_output_dim=32, pixel_shuffle_ratio=0.5),
        dict(image_token_index=500), "Llama4ForCausalLM"),
    # Mistral Small 4: DeepSeek-V3's MLA with softmax scores (no bias) ranked in 4 groups by
    # their best two (2 eligible), 3 experts a token of 8, renormalised and scaled; YaRN, and
    # the queries scaled by position past each 4
    "mistral3:mistral4": (
        dict(model_type="mistral4", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=512, bos_token_id=1,
             eos_token_id=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3,
             n_group=4, topk_group=2, moe_intermediate_size=24, n_shared_experts=1,
             first_k_dense_replace=1, routed_scaling_factor=1.5, max_position_embeddings=512,
             initializer_range=0.2,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 4, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "llama_4_scaling_beta": 0.1}),
        _PIXTRAL, dict(image_token_index=500), "Mistral4ForCausalLM"),
}

# Qwen3-VL-MoE: Qwen3-VL's model with experts in layers 0 and 2 (4 of width 48, 2 a token)
MULTIMODAL["qwen3_vl_moe"] = (
    {**MULTIMODAL["qwen3_vl"][0], "moe_intermediate_size": 48, "num_experts": 4,
     "num_experts_per_tok": 2, "mlp_only_layers": [1], "num_hidden_layers": 3},
    *MULTIMODAL["qwen3_vl"][1:3], "Qwen3MoeForCausalLM")


def make_tiny_multimodal(kind: str, path, seed: int = 0) -> Path:
    """Save the random multimodal model MULTIMODAL[kind] (float32, by transformers) into the
    folder `path`."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text, vision, extra, _ = MULTIMODAL[kind]
    cfg = AutoConfig.for_model(kind.partition(":")[0], text_config=text, vision_config=vision,
                               **extra)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(path)
    return Path(path)
