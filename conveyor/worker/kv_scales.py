"""Per-layer scales of the fp8 KV cache, calibrated once when the worker starts.

float8 e4m3 holds magnitudes up to 448 with 3 mantissa bits (normal from 2**-6 up). A layer
stores K / k_scale and V / v_scale; the scale is amax * MARGIN / 448, where amax is the largest
|K| (|V|) the layer writes during one forward pass over CALIBRATION_TOKENS fixed pseudo-random
token ids (no tokenizer needed; the same ids on every rank). Each rank measures its own heads.
Why calibrate and why this margin: docs/ARCHITECTURE.md, "fp8 KV cache".
"""
from __future__ import annotations

import math

import torch
from torch import nn

from conveyor.kernels._util import FP8_MAX
from conveyor.shared.config import EngineConfig
from conveyor.shared.model_config import ModelConfig
from conveyor.worker.context import StepContext
from conveyor.worker.kv_cache import allocate_kv_cache
from conveyor.worker.layers.attention import Attention, default_backend

CALIBRATION_TOKENS = 512
MARGIN = 4.0          # the calibrated amax lands at 448 / 4: headroom for larger values later


class _AmaxRecorder:
    """An attention backend that notes the largest |K| and |V| written, then delegates."""

    def __init__(self, inner):
        self.inner = inner
        self.amax: list[torch.Tensor] = []           # [2] per write_kv: |K| max, |V| max

    def write_kv(self, kv_cache, k, v, slot_mapping, k_scale=1.0, v_scale=1.0):
        self.amax.append(torch.stack([k.abs().amax(), v.abs().amax()]).float())
        self.inner.write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale)

    def forward(self, *args, **kwargs):
        return self.inner.forward(*args, **kwargs)


def attention_layers(model: nn.Module) -> list[Attention]:
    return sorted((m for m in model.modules() if isinstance(m, Attention)),
                  key=lambda m: m.layer_idx)


def scale_for(amax: float) -> float:
    """amax * MARGIN / 448; 1.0 where nothing (or nothing finite) was measured."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return amax * MARGIN / FP8_MAX


def calibration_ids(vocab_size: int, n: int) -> torch.Tensor:
    """The fixed pseudo-random token ids of the calibration pass, [n] int64 on the CPU."""
    return torch.randint(vocab_size, (n,), generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def calibrate_kv_scales(model: nn.Module, model_config: ModelConfig, config: EngineConfig,
                        max_model_len: int, dtype: torch.dtype, device: torch.device
                        ) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer, from one prefill over a pool in the model's dtype."""
    n = min(CALIBRATION_TOKENS, max_model_len)
    ids = calibration_ids(model_config.vocab_size, n).to(device)
    blocks = -(-n // config.block_size)
    ctx = StepContext(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        kv_caches=allocate_kv_cache(model_config, config, blocks, dtype, device),
        query_lens_cpu=[n], seq_lens_cpu=[n])
    layers = attention_layers(model)
    saved = [layer.backend for layer in layers]
    recorders = [_AmaxRecorder(b or default_backend(device.type == "cuda")) for b in saved]
    try:
        for layer, rec in zip(layers, recorders):
            layer.backend = rec
        model(ids, torch.arange(n, device=device), ctx)
    finally:
        for layer, backend in zip(layers, saved):
            layer.backend = backend
    amax = torch.stack([torch.stack(r.amax).amax(0) for r in recorders]).tolist()  # [L, 2]
    return [(scale_for(k), scale_for(v)) for k, v in amax]


def set_kv_scales(model: nn.Module, scales: list[tuple[float, float]]) -> None:
    layers = attention_layers(model)
    if len(scales) != len(layers):
        raise ValueError(f"{len(scales)} scale pairs for {len(layers)} attention layers")
    for layer, (k_scale, v_scale) in zip(layers, scales):
        layer.k_scale, layer.v_scale = float(k_scale), float(v_scale)
