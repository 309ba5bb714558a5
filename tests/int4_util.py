"""Write a tiny model's linear layers as a published 4-bit checkpoint (AutoAWQ's GEMM format or
GPTQ's, with act-order optionally), packed here by the formats' documented layouts (as
transformers', AutoAWQ's and AutoGPTQ's unpacking code reads them), and the same model with the
dequantized weights in float32, for transformers to run as the reference."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Hugging Face's linear layers, and Mixtral's experts (w1 gate, w3 up, w2 down)
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1",
           "w2", "w3")
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _pack(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[R, 8 C] 4-bit values -> int32 [R, C], nibble i of word c = value 8c + order[i]."""
    r, n = values.shape
    v = values.long().view(r, n // 8, 8)[:, :, list(order)]
    words = sum(v[:, :, i] << (4 * i) for i in range(8))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def quantize(w: torch.Tensor, group: int, perm: torch.Tensor):
    """Asymmetric 4-bit per group of the inputs perm[j * group:(j + 1) * group] (group -1: the
    whole row): -> q [N, K], zero [N, G] (1..15), scale fp16 [N, G], and the dequantized weight
    [N, K] float32."""
    n, k = w.shape
    group = group if group > 0 else k
    groups = perm.view(-1, group)                               # [G, group] input indices
    wg = w[:, groups]                                           # [N, G, group]
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    s = scale.float()
    zero = (-lo / s).round().clamp(1, 15)
    q = ((wg / s[..., None]).round() + zero[..., None]).clamp(0, 15)
    deq = torch.empty_like(w)
    deq[:, groups] = (q - zero[..., None]) * s[..., None]
    qk = torch.empty(n, k, dtype=torch.long)
    qk[:, groups] = q.long()
    return qk, zero.long(), scale, deq


def write_int4(src: Path, dst: Path, ref: Path, fmt: str, group: int, act_order: bool = False,
               seed: int = 0) -> None:
    """src: a float32 HF folder -> dst: its 4-bit checkpoint; ref: the dequantized float model."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "model.safetensors")
    out, deq_all = {}, dict(tensors)
    perms = {}    # act-order follows the input's statistics: q/k/v (gate/up) share one order
    for name, w in _linear(tensors, out):
        n, k = w.shape
        perm = _input_order(name, k, perms, act_order, gen)
        q, zero, scale, deq = quantize(w.float(), group, perm)
        deq_all[name] = deq
        prefix = name.removesuffix(".weight")
        if fmt == "awq":
            out[f"{prefix}.qweight"] = _pack(q.t().contiguous(), _AWQ_ORDER)     # [K, N / 8]
            out[f"{prefix}.qzeros"] = _pack(zero.t().contiguous(), _AWQ_ORDER)   # [G, N / 8]
        else:
            out[f"{prefix}.qweight"] = _pack(q.contiguous()).t().contiguous()   # [K / 8, N]
            out[f"{prefix}.qzeros"] = _pack((zero - 1).t().contiguous())        # [G, N / 8]
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // (group if group > 0 else k)).int()
            out[f"{prefix}.g_idx"] = g_idx
        out[f"{prefix}.scales"] = scale.t().contiguous()                       # [G, N]
    _save(src, dst, ref, out, deq_all,
          {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
           "version": "gemm"} if fmt == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
           "sym": False, "checkpoint_format": "gptq"})


def write_w4a16(src: Path, dst: Path, ref: Path, group: int, symmetric: bool,
                act_order: bool = False, seed: int = 0) -> None:
    """src: a float32 HF folder -> dst: its compressed-tensors pack-quantized (W4A16)
    checkpoint as llm-compressor saves one, packed by compressed-tensors itself (group 0: one
    scale a row, the channel strategy; zero points packed along the outputs, as vLLM reads
    them); ref: the dequantized float model. transformers runs a symmetric dst through
    compressed-tensors (whose current version refuses act-order's g_idx, and sizes zero points
    unpacked)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "model.safetensors")
    out, perms, deq_all = {}, {}, dict(tensors)
    for name, w in _linear(tensors, out):
        n, k = w.shape
        size = group or k
        perm = _input_order(name, k, perms, act_order, gen)
        if symmetric:
            groups = perm.view(-1, size)
            wg = w.float()[:, groups]                                        # [N, G, size]
            scale = (wg.abs().amax(-1) / 7.5).clamp(min=1e-6)
            qg = (wg / scale[..., None]).round().clamp(-8, 7)
            q = torch.empty(n, k)
            q[:, groups] = qg
            deq_all[name] = torch.empty(n, k)
            deq_all[name][:, groups] = qg * scale[..., None]
        else:
            q_u, zero, scale, deq_all[name] = quantize(w.float(), size, perm)
            q, scale = q_u - 8, scale.float()
            out[name.removesuffix(".weight") + ".weight_zero_point"] = pack_to_int32(
                (zero - 8).to(torch.int8), 4, packed_dim=0)                   # [N / 8, G]
        prefix = name.removesuffix(".weight")
        out[f"{prefix}.weight_packed"] = pack_to_int32(q.to(torch.int8), 4)    # [N, K / 8]
        out[f"{prefix}.weight_scale"] = scale.float().contiguous()             # [N, G]
        out[f"{prefix}.weight_shape"] = torch.tensor([n, k])
        if act_order:
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // size).int()
            out[f"{prefix}.weight_g_idx"] = g_idx
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric,
               "strategy": "group" if group else "channel", "group_size": group or None,
               "dynamic": False, "actorder": "group" if act_order else None,
               "observer": "minmax"}
    _save(src, dst, ref, out, deq_all, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}}})


def write_gptq8(src: Path, dst: Path, ref: Path, group: int) -> None:
    """src: a float32 HF folder -> dst: its 8-bit GPTQ checkpoint (symmetric, in order: the
    layout of Qwen's GPTQ-Int8 releases, 4 values an int32 along K, zero points 128 stored
    as 127); ref: the dequantized float model."""
    tensors = load_file(src / "model.safetensors")
    out, deq_all = {}, dict(tensors)

    def pack8(values: torch.Tensor) -> torch.Tensor:      # [R, 4 C] bytes -> int32 [R, C]
        v = values.long().view(values.shape[0], -1, 4)
        words = sum(v[:, :, i] << (8 * i) for i in range(4))
        return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

    for name, w in _linear(tensors, out):
        n, k = w.shape
        size = group or k
        wg = w.float().view(n, k // size, size)
        scale = (wg.abs().amax(-1) / 127).clamp(min=1e-6).half()           # [N, G]
        q = ((wg / scale.float()[..., None]).round().clamp(-128, 127) + 128).view(n, k)
        deq_all[name] = ((q.view(n, k // size, size) - 128) * scale.float()[..., None]).view(n, k)
        prefix = name.removesuffix(".weight")
        out[f"{prefix}.qweight"] = pack8(q.contiguous()).t().contiguous()     # [K / 4, N]
        out[f"{prefix}.qzeros"] = pack8(torch.full((k // size, n), 127))     # [G, N / 4]
        out[f"{prefix}.scales"] = scale.t().contiguous()                     # [G, N]
        out[f"{prefix}.g_idx"] = (torch.arange(k) // size).int()
    _save(src, dst, ref, out, deq_all, {"quant_method": "gptq", "bits": 8,
                                        "group_size": group or -1, "desc_act": False,
                                        "sym": True, "checkpoint_format": "gptq"})


def _save(src: Path, dst: Path, ref: Path, out: dict, deq_all: dict, qc: dict) -> None:
    """dst: src's files with the tensors `out` and quantization_config `qc`; ref: the same
    with the dequantized tensors `deq_all` (a float model for transformers)."""
    for folder, data in ((dst, out), (ref, deq_all)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
        save_file({k: v.contiguous() for k, v in data.items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))


def _input_order(name: str, k: int, perms: dict, act_order: bool, gen) -> torch.Tensor:
    """The order a layer's inputs were quantized in (act-order: random, shared by the layers
    that read the same input: q/k/v, gate/up); else 0..k-1."""
    proj = name.split(".")[-2]
    shared_input = name.rsplit(".", 2)[0] + {"k_proj": ".q_proj", "v_proj": ".q_proj",
                                               "up_proj": ".gate_proj"}.get(proj, "." + proj)
    if shared_input not in perms:
        perms[shared_input] = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    return perms[shared_input]


def _linear(tensors: dict, out: dict):
    """The linear layers' (name, weight) of `tensors`; the other tensors go into `out`."""
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in _LINEAR:
            yield name, w
        else:
            out[name] = w
