"""The tensors of a GGUF file under Hugging Face names, in torch layout: llama.cpp's tensor names
mapped back, what its converter changed undone (q/k row order of "llama" models, Gemma's norms
stored as 1 + w), and Q8_0 blocks either dequantized or kept as int8 values with their scales
(the loader, worker/loader.py, decides which). A mixture of experts' stacked tensors
(blk.N.ffn_gate_exps and the like, [E, out, in], and their biases [E, out]) are dequantized and
given as each expert's projection; gpt-oss's experts in ggml's MXFP4 may instead be kept in 4
bits, their blocks rearranged into the published checkpoint's (`mxfp4_blocks`). Phi-3's fused
attn_qkv and ffn_up (gate and up) keep Hugging Face's fused names.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from conveyor.worker.layers.quantization import Q8_0_GROUP

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",                  # a mixture of experts' router
}
# where an architecture's GGUF names stand for other modules than llama's
_GEMMA_LAYER = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER = {"gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER,
               "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
               "gpt-oss": {"post_attention_norm": "post_attention_layernorm",
                           "attn_sinks": "self_attn.sinks"}}
# Hugging Face parameters that are no module's weight (the GGUF name adds ".weight")
_PARAMETERS = ("self_attn.sinks",)
# NOTE: llama.cpp multiplies by a norm's weight where Gemma multiplies by 1 + weight: its
# converter stores 1 + w for every Gemma norm (Hugging Face names ending "norm.weight")
_NORM_PLUS_ONE = ("gemma2", "gemma3")
# LongRoPE's factors (in the config, shared/model_files.py) and llama 3's recomputed scaling
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# a mixture's experts, stacked [E, out, in]: loaded as each expert's projection
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_GGUF_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def expert_names(tensor) -> list[str] | None:
    """The Hugging Face names of a stacked experts tensor's experts (weights or biases), in
    order (None for any other tensor)."""
    m = _GGUF_LAYER_NAME.fullmatch(tensor.name)
    if not (m and m.group(2) in _GGUF_EXPERTS):
        return None
    return [f"model.layers.{m.group(1)}.mlp.experts.{e}.{_GGUF_EXPERTS[m.group(2)]}."
            f"{m.group(3)}" for e in range(len(tensor.data))]


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of a model of GGUF architecture `arch`, or None if
    it has none."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_LAYER_NAME.fullmatch(name)
    layer = {**_GGUF_LAYER, **_ARCH_LAYER.get(arch, {})}
    if m is None or m.group(2) not in layer:
        return None
    module = layer[m.group(2)]
    if module in _PARAMETERS:
        return f"model.layers.{m.group(1)}.{module}"
    return f"model.layers.{m.group(1)}.{module}.{m.group(3)}"


def _unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows (per head: interleaved pairs -> two halves)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_weights(reader, int8_names: set[str] = frozenset(), mxfp4: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a GGUF file (an open gguf.GGUFReader) in torch layout [out, in] under
    Hugging Face names, dequantized to float32; Q8_0 tensors named in `int8_names` instead as
    int8 values and their float32 scales [out, in / 32] (under the name + "_scale"), a stack of
    experts whose first expert is named there likewise for each expert. With `mxfp4`, stacks
    of experts in MXFP4 come as each expert's int32 words and uint8 e8m0 scales [out, in / 32]
    (worker/mxfp4_checkpoint.py's mxfp4_words; FusedMoE.make_mxfp4)."""
    import gguf

    from conveyor.worker.mxfp4_checkpoint import mxfp4_words

    fields = reader.fields
    arch = fields["general.architecture"].contents()
    heads = fields[f"{arch}.attention.head_count"].contents()
    kv_field = fields.get(f"{arch}.attention.head_count_kv")
    kv_heads = heads if kv_field is None else kv_field.contents()
    # NOTE: llama.cpp's converter permutes the q/k rows of "llama" models only.
    permuted = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads} if arch == "llama" else {}
    for tensor in reader.tensors:
        experts = expert_names(tensor)
        if experts is not None and experts[0] in int8_names:
            data = tensor.data
            q, scale = q8_0_blocks(data.reshape(-1, data.shape[-1]))
            for name, qe, se in zip(experts, q.view(len(experts), -1, q.shape[1]),
                                    scale.view(len(experts), -1, scale.shape[1])):
                yield name, qe
                yield name + "_scale", se
            continue
        if experts is not None and mxfp4 and tensor.tensor_type == gguf.GGMLQuantizationType.MXFP4:
            words, scales = mxfp4_words(*mxfp4_blocks(tensor.data))
            for name, w, scale in zip(experts, words, scales):
                yield name, w
                yield name + "_scale", scale
            continue
        if experts is not None:
            stacked = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            yield from zip(experts, torch.from_numpy(stacked.copy()))
            continue
        name = gguf_to_hf_name(tensor.name, arch)
        if name is None:
            if tensor.name in _ROPE_TENSORS:
                continue
            name = f"<gguf>{tensor.name}"            # reported as unexpected
        if name in int8_names:
            out = dict(zip((name, name + "_scale"), q8_0_blocks(tensor.data)))
        else:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
                array = array - 1
            out = {name: torch.from_numpy(array if array.flags.writeable else array.copy())}
        for key, w in out.items():
            for module, n in permuted.items():
                if f".{module}." in key:     # NOTE: whole rows move: q and scales alike
                    w = _unpermute_rotary(w, n)
            yield key, w


def q8_0_blocks(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's bytes [N, K / 32 * 34] (per block: fp16 scale, then 32 int8 values) ->
    (q [N, K] int8, scale [N, K / 32] float32); q * scale is what gguf dequantizes to."""
    blocks = data.reshape(data.shape[0], -1, 2 + Q8_0_GROUP)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(data.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(scale)


def mxfp4_blocks(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 bytes [..., K / 32 * 17] -> the published checkpoint's (blocks uint8
    [..., K / 32, 16], scales uint8 [..., K / 32]), the same codes and exponents: a ggml block
    is its e8m0 byte, then 16 bytes whose low nibbles are values 0-15 and high nibbles values
    16-31; the checkpoint's byte i holds values 2i (low) and 2i + 1 (high). llama.cpp's
    converter made the one from the other (transform_nibble_layout): this undoes it."""
    blocks = data.reshape(*data.shape[:-1], -1, 1 + 16)
    codes = blocks[..., 1:]
    values = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)     # [..., G, 32]
    packed = values[..., 0::2] | (values[..., 1::2] << 4)
    return torch.from_numpy(packed), torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
