"""Tiny random Hugging Face models, saved as real folders, for comparing conveyor against
transformers without downloading anything.
"""
from __future__ import annotations

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
    config = getattr(transformers, config_class)(**{**_COMMON, **extra, **overrides})
    if not weights:
        config.architectures = [config_class.replace("Config", "ForCausalLM")]
        config.save_pretrained(path)
        return Path(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():   # HF initialises norms to ones and biases to zeros: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(path)
    model.save_pretrained(path)
    return path
