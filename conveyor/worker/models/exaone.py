"""EXAONE 3.0 / 3.5 (`ExaoneForCausalLM`: EXAONE-3.0-7.8B, EXAONE-3.5-2.4B/7.8B/32B, EXAONE Deep):
Llama under GPT-2's names (transformer.h.N.attn.attention.q_proj, ln_1, mlp.c_fc_0, ...),
mapped at load; config.json's num_layers and layer_norm_epsilon are read as
num_hidden_layers and rms_norm_eps (shared/model_config.py).
"""
from __future__ import annotations

from conveyor.worker.models.llama import LlamaForCausalLM, renamer


class ExaoneForCausalLM(LlamaForCausalLM):
    checkpoint_name = renamer({
        "transformer.wte.": "model.embed_tokens.", "transformer.h.": "model.layers.",
        "transformer.ln_f.": "model.norm.", ".attn.attention.out_proj.": ".self_attn.o_proj.",
        ".attn.attention.": ".self_attn.", ".ln_1.": ".input_layernorm.",
        ".ln_2.": ".post_attention_layernorm.", ".mlp.c_fc_0.": ".mlp.gate_proj.",
        ".mlp.c_fc_1.": ".mlp.up_proj.", ".mlp.c_proj.": ".mlp.down_proj."})
