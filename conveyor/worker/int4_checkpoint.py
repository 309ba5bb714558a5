"""4-bit checkpoints as published: AutoAWQ's GEMM format, GPTQ and compressed-tensors'
pack-quantized ("w4a16"), read into the one layout the
W4A16 kernels take (kernels/w4a16_gemm.py: qweight [N, K / 8] packed along K, float32 scale and
zero [N, G], and for GPTQ act-order the column order `perm`).

The formats, per linear layer `P` (K inputs, N outputs, groups of g inputs, G = K / g):
- AWQ: P.qweight int32 [K, N / 8] packed along N, nibble i of word c holding output column
  8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; P.qzeros int32 [G, N / 8] packed the same way; P.scales
  [G, N]; W[n, k] = (q - zero) * scale.
- GPTQ: P.qweight int32 [K / 8, N] packed along K, nibble i of word r holding input row 8r + i;
  P.qzeros int32 [G, N / 8] packed along N in order, storing zero - 1 (checkpoint_format
  "gptq"; "gptq_v2" stores the zero itself); P.scales [G, N]; P.g_idx int32 [K], the group of
  each input (act-order, desc_act, permutes them). The columns are sorted by group here, so the
  kernel reads contiguous groups, and the layer gathers its input the same way (x[:, perm]).
- GPTQ in 8 bits (symmetric, in order: Qwen's GPTQ-Int8): P.qweight int32 [K / 4, N], byte i
  of word r holding input 4r + i; P.qzeros [G, N / 4] the same along N (128, less the offset);
  P.scales [G, N]. They become int8 weights q - 128 [N, K] and scales [N, G] (`convert_gptq8`),
  which the int8 path runs as GGUF's Q8_0 (one scale a group).
- w4a16 (compressed-tensors' pack-quantized): P.weight_packed int32 [N, K / 8] packed along K,
  nibble i of word w holding input 8w + i as q + 8 (the kernels' own layout); P.weight_scale
  [N, G]; P.weight_zero_point int32 [N / 8, G] packed along N, zero + 8 (asymmetric only: a
  symmetric layer's zero is 8); P.weight_g_idx int32 [K] (act-order "group", as GPTQ's g_idx);
  P.weight_shape [N, K].
"""
from __future__ import annotations

import torch

from conveyor.kernels.w4a16_gemm import pack_int4

_AWQ_REVERSE = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
# each format's parts: words, zero points, scales, then act-order's group index (and others)
_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "gptq8": ("qweight", "qzeros", "scales", "g_idx"),
          "w4a16": ("weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx",
                    "weight_shape")}


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [R, 8 C] uint8: nibble i of word c at column 8c + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 15).to(torch.uint8).reshape(packed.shape[0], -1)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's packing along N -> [R, N] in column order."""
    q = _nibbles(packed)
    order = (torch.arange(q.shape[1]).view(-1, 8)[:, _AWQ_REVERSE]).reshape(-1)
    return q[:, order.to(q.device)]


def convert_layer(fmt: str, tensors: dict[str, torch.Tensor], zero_offset: int,
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors (the format's parts above) -> weight [N, K / 8] int32,
    weight_scale and weight_zero [N, G] float32, and for GPTQ and w4a16 weight_perm [K] int64
    (identity without act-order), on `device`. zero_offset: 1 for GPTQ's "gptq" format. The
    unpacking and repacking make a few int64 passes over every weight: on a GPU they take a
    second for an 8B model, on the host most of a minute."""
    tensors = {name: t.to(device) for name, t in tensors.items()}
    if fmt == "w4a16":
        return _convert_packed(tensors)
    if fmt == "gptq8":
        return convert_gptq8(tensors, zero_offset)
    scales = tensors["scales"].float()                         # [G, N]
    g, n = scales.shape
    if fmt == "awq":
        q = _awq_columns(tensors["qweight"])                   # [K, N]
        zeros = _awq_columns(tensors["qzeros"])                # [G, N]
        out = {}
    else:
        packed = tensors["qweight"]                            # [K / 8, N]
        q = _nibbles(packed.t().contiguous()).t()              # [K, N]
        zeros = _nibbles(tensors["qzeros"])                    # [G, N]
        k = q.shape[0]
        perm = _group_order(tensors.get("g_idx"), k, g)
        q = q[perm]
        out = {"weight_perm": perm}
    k = q.shape[0]
    if q.shape[1] != n or zeros.shape != (g, n) or k % g:
        raise ValueError(f"{fmt} tensors do not agree: qweight gives {tuple(q.shape)}, "
                         f"scales {tuple(scales.shape)}, qzeros {tuple(zeros.shape)}")
    out.update(weight=pack_int4(q.t().contiguous()), weight_scale=scales.t().contiguous(),
               weight_zero=(zeros.float() + zero_offset).t().contiguous())
    return out


def convert_gptq8(tensors: dict[str, torch.Tensor], zero_offset: int
                  ) -> dict[str, torch.Tensor]:
    """One 8-bit GPTQ layer -> int8 weight [N, K] (q - 128) and float32 weight_scale [N, G].
    Its zero points must all be 128 (symmetric) and its g_idx, if any, in order."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=tensors["qweight"].device)

    def unpack(words: torch.Tensor) -> torch.Tensor:     # [R, C] -> [R, 4 C], byte i at 4c + i
        return ((words[:, :, None] >> shifts) & 255).reshape(words.shape[0], -1)

    scales = tensors["scales"].float()                                       # [G, N]
    g, n = scales.shape
    q = unpack(tensors["qweight"].t().contiguous())                          # [N, K]
    zeros = unpack(tensors["qzeros"]) + zero_offset                          # [G, N]
    k = q.shape[1]
    if q.shape[0] != n or zeros.shape != (g, n) or k % g:
        raise ValueError(f"gptq 8-bit tensors do not agree: qweight gives {tuple(q.shape)}, "
                         f"scales {tuple(scales.shape)}, qzeros {tuple(zeros.shape)}")
    if (zeros != 128).any():
        raise ValueError("8-bit GPTQ zero points other than 128 (asymmetric) are not supported")
    if not torch.equal(_group_order(tensors.get("g_idx"), k, g).cpu(), torch.arange(k)):
        raise ValueError("8-bit GPTQ act-order (a g_idx out of order) is not supported")
    return {"weight": (q - 128).to(torch.int8), "weight_scale": scales.t().contiguous()}


def _group_order(g_idx: torch.Tensor | None, k: int, g: int) -> torch.Tensor:
    """The input order that makes g_idx's groups (act-order's scattered inputs) contiguous,
    [K] int64 (the identity without g_idx)."""
    groups = torch.arange(k, device=g_idx.device if g_idx is not None else "cpu") // (k // g)
    g_idx = groups if g_idx is None else g_idx.long()
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], groups):
        raise ValueError(f"g_idx does not make {g} groups of {k // g} inputs")
    return perm


def _convert_packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized layer: its words are the kernels' layout already,
    but for act-order (the columns sorted by group, as GPTQ's)."""
    words, scales = tensors["weight_packed"], tensors["weight_scale"].float()    # [N, G]
    n, g = scales.shape
    k = words.shape[1] * 8
    if words.shape[0] != n or k % g:
        raise ValueError(f"w4a16 tensors do not agree: weight_packed {tuple(words.shape)}, "
                         f"weight_scale {tuple(scales.shape)}")
    zp = tensors.get("weight_zero_point")
    zeros = (torch.full_like(scales, 8.0) if zp is None
             else _nibbles(zp.t().contiguous()).t()[:n].float())                  # [N, G]
    out = {"weight_scale": scales.contiguous(), "weight_zero": zeros.contiguous()}
    if "weight_g_idx" in tensors:
        perm = _group_order(tensors["weight_g_idx"], k, g)
        words = pack_int4(_nibbles(words)[:, perm].contiguous())
        out["weight_perm"] = perm
    out["weight"] = words.contiguous()
    return out


def packed_layers(fmt: str, names: list[str]) -> tuple[list[str], bool, bool]:
    """Of a checkpoint's tensor names: the packed layers (as `P.weight`), and whether they
    carry act-order's group index and zero points (a symmetric w4a16 one has none)."""
    words, zeros, _, g_idx = (_PARTS[fmt] + (None,))[:4]
    layers = [n.removesuffix(words) + "weight" for n in names if n.endswith("." + words)]

    def has(part: str | None) -> bool:
        return part is not None and any(n.endswith("." + part) for n in names)

    return layers, has(g_idx), has(zeros)


def int4_weights(weights, fmt: str, zero_offset: int, has_g_idx: bool,
                 device: torch.device | str = "cpu", has_zero: bool = True):
    """Checkpoint tensors with every 4-bit layer's parts (buffered until all have come) turned
    into `convert_layer`'s tensors under that layer's name, converted on `device`; other
    tensors pass unchanged."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    words, zeros, scales = _PARTS[fmt][:3]
    want = {words, scales} | ({zeros} if has_zero else set())
    want |= {_PARTS[fmt][3]} if has_g_idx else set()
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS[fmt]:
            yield name, tensor
            continue
        if part == "weight_shape":           # [N, K]: what weight_packed and the model say
            continue
        layer = pending.setdefault(prefix, {})
        layer[part] = tensor
        if want <= layer.keys():
            for key, t in convert_layer(fmt, pending.pop(prefix), zero_offset, device).items():
                yield f"{prefix}.{key}", t
    if pending:
        raise ValueError(f"incomplete 4-bit layers in the checkpoint: {', '.join(pending)}")
