"""bitsandbytes checkpoints (`"quant_method": "bitsandbytes"`, what transformers saves for a
model loaded with load_in_8bit or load_in_4bit, as the hub's "bnb-4bit" releases are).

8-bit (LLM.int8): each quantized layer's `weight` is int8 [N, K] and `SCB` float32 [N] its rows'
absolute maxima, W = weight * SCB / 127: the int8 layout of an int-quantized checkpoint, so it
loads as int8 weights with one scale a row (`weight_scale` = SCB / 127) and runs W8A16. The
outlier threshold is a runtime setting of bitsandbytes' own matmul, not part of the weights.

4-bit (NF4 or FP4): each quantized layer's `weight` holds the flattened [N, K] weight's 4-bit
codes, two a byte (the first in the high nibble), beside `weight.quant_map` (the 16 values a
code stands for), `weight.absmax` (one scale a block of `blocksize` weights) and
`weight.quant_state.bitsandbytes__nf4` (or __fp4: JSON of the block size, the shape and, with
double quantization, `nested_offset`); with double quantization absmax is itself 8-bit codes of
`weight.nested_quant_map`, scaled by `weight.nested_absmax` a block of nested_blocksize, plus
nested_offset. W = quant_map[code] * absmax[i // blocksize] in the state's dtype (that of the
model the checkpoint was made from), which is what this module gives: the weights are
dequantized at load, as bitsandbytes dequantizes them, and run in the model's dtype (or are
quantized again with --quantization). bitsandbytes itself is not needed.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from conveyor.worker.checkpoint_files import Checkpoint, Weights

_STATE = ".quant_state.bitsandbytes__"
_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def is_bitsandbytes(qc: dict[str, Any] | None) -> bool:
    return bool(qc) and qc.get("quant_method") == "bitsandbytes"


def bnb_weights(checkpoint: Checkpoint) -> Weights:
    """A bitsandbytes checkpoint's tensors as load_weights takes them: 8-bit weights with their
    scales as `weight_scale` [N], 4-bit ones dequantized; the rest unchanged."""
    # the 4-bit weights: those with a quant_state beside them
    four_bit = {_owner(n) for n in checkpoint.names() if _STATE in n}
    pending: dict[str, dict[str, Any]] = {}       # 4-bit weight name -> its parts so far
    for name, tensor in checkpoint.weights():
        if name.endswith(".SCB"):
            yield name.removesuffix("SCB") + "weight_scale", tensor.float() / 127.0
        elif name.endswith(".weight_format"):
            if int(tensor.reshape(-1)[0]) != 0:
                raise ValueError(f"{name}: bitsandbytes 8-bit weights in a tiled format "
                                 f"({int(tensor.reshape(-1)[0])}); conveyor loads the row "
                                 f"format (0) that bitsandbytes saves")
        elif (weight := name if name in four_bit else _owner(name)) in four_bit:
            parts = pending.setdefault(weight, {})
            parts[name.removeprefix(weight).removeprefix(".") or "weight"] = tensor
            if _complete(parts):
                yield weight, dequantize_bnb4(pending.pop(weight))
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"bitsandbytes 4-bit weights without all their parts: "
                         f"{sorted(pending)[:4]}")


def _owner(name: str) -> str | None:
    """The weight a 4-bit quantization part belongs to (`X.weight.absmax` -> `X.weight`)."""
    if _STATE in name:
        return name[:name.index(_STATE)]
    head, _, part = name.rpartition(".")
    return head if part in _PARTS else None


def _complete(parts: dict[str, Any]) -> bool:
    state = next((k for k in parts if k.startswith(_STATE[1:])), None)
    if state is None or "weight" not in parts:
        return False
    nested = "nested_blocksize" in _state(parts[state])
    need = ("absmax", "quant_map") + (("nested_absmax", "nested_quant_map") if nested else ())
    return all(p in parts for p in need)


def _state(tensor: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode())


def dequantize_bnb4(parts: dict[str, Any]) -> torch.Tensor:
    """One 4-bit weight's parts (`weight`, `absmax`, `quant_map`, the quant_state entry, and
    with double quantization the nested ones) -> W [N, K] in the state's dtype."""
    state_key = next(k for k in parts if k.startswith(_STATE[1:]))
    state = _state(parts[state_key])
    absmax = parts["absmax"]
    if "nested_blocksize" in state:
        codes = parts["nested_quant_map"].float()[absmax.long().reshape(-1)]
        scale = parts["nested_absmax"].float().repeat_interleave(state["nested_blocksize"])
        absmax = codes * scale[:codes.numel()] + float(state["nested_offset"])
    packed = parts["weight"].contiguous().view(torch.uint8).reshape(-1)
    codes = torch.stack((packed >> 4, packed & 15), dim=1).reshape(-1).long()
    shape = tuple(state["shape"])
    numel = shape[0] * shape[1]
    block = state["blocksize"]
    if codes.numel() < numel or absmax.numel() * block < numel:
        raise ValueError(f"bitsandbytes 4-bit weight of shape {shape}: {packed.numel()} bytes "
                         f"and {absmax.numel()} block scales are too few")
    w = parts["quant_map"].float()[codes[:numel]]
    w = w * absmax.float().reshape(-1).repeat_interleave(block)[:numel]
    # NOTE: rounded to the dtype the state names, as bitsandbytes' own dequantization is
    return w.reshape(shape).to(getattr(torch, state.get("dtype", "float32")))
