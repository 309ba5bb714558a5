"""The attention layer of a model: store this step's K/V in the paged pool, then attend.

q, k, v arrive flat ([T, heads * head_dim], this rank's heads only); the pool of layer
`layer_idx` is ctx.kv_caches[cache_index] (layer_idx, but a pipeline stage's pools are its own
layers' only). The math is the backend's: Triton kernels on CUDA
(where Triton is installed), plain torch elsewhere, unless a backend is given.

k_scale and v_scale (Python floats, so CUDA graphs capture them) are the fp8 pool's per-layer
scales: K/V are stored divided by them and read back multiplied; 1.0 for a model-dtype pool.
`window` (a sliding window: each query sees its last `window` positions; 0 = all), `chunk`
(Llama 4's chunked attention: a query sees its chunk's positions up to itself; 0 = all) and
`softcap` (scores -> softcap * tanh(scores / softcap); 0 = off) are fixed per layer, so a CUDA
graph captures them too. A model with attention sinks (gpt-oss) passes its per-head sink logits
to forward: the same tensor every step, so a graph captures its address.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels import triton_available
from conveyor.worker.attention_backend import TorchAttentionBackend
from conveyor.worker.context import StepContext


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, backend=None, window: int = 0, softcap: float = 0.0,
                 cache_index: int | None = None, chunk: int = 0):
        """cache_index: this layer's pool in ctx.kv_caches (default layer_idx; a pipeline
        stage's pools are its own layers only)."""
        super().__init__()
        self.window = window
        self.chunk = chunk
        self.softcap = softcap
        self.layer_idx = layer_idx
        self.cache_index = layer_idx if cache_index is None else cache_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                ctx: StepContext, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's k and v ([T, kv_heads, head_dim], or flat) in the pool (None: the
        caller already has, fused into its rotary kernel), then attend q [T, heads * head_dim]
        to the pool; sinks [heads]: a logit per head that joins each softmax's denominator."""
        t = q.shape[0]
        kv_cache = ctx.kv_caches[self.cache_index]
        backend = self.backend or default_backend(q.is_cuda)
        if k is not None:
            backend.write_kv(kv_cache, k.view(t, self.num_kv_heads, self.head_dim),
                             v.view(t, self.num_kv_heads, self.head_dim), ctx.slot_mapping,
                             self.k_scale, self.v_scale)
        out = backend.forward(q.view(t, self.num_heads, self.head_dim), kv_cache, ctx,
                              self.scale, self.k_scale, self.v_scale, self.window,
                              self.softcap, sinks, self.chunk)     # [T, heads, head_dim]
        return out.reshape(t, self.num_heads * self.head_dim)

    def fused_store(self, v: torch.Tensor, ctx: StepContext) -> dict:
        """rotary_qk's keywords that store this step's k and v [T, kv_heads * head_dim] into this
        layer's pool in the rotary kernel (then forward() takes k = v = None); {} where a backend
        of the layer's own (the fp8 calibration's recorder) must see k and v in write_kv."""
        if self.backend is not None:
            return {}
        return dict(v=v.view(v.shape[0], self.num_kv_heads, self.head_dim),
                    kv_cache=ctx.kv_caches[self.cache_index], slot_mapping=ctx.slot_mapping,
                    k_scale=self.k_scale, v_scale=self.v_scale)


_TORCH_BACKEND = TorchAttentionBackend()
_TRITON_BACKEND = None


def default_backend(cuda: bool):
    """The Triton backend for CUDA tensors where Triton is installed, else the torch one."""
    global _TRITON_BACKEND
    if not (cuda and triton_available()):
        return _TORCH_BACKEND
    if _TRITON_BACKEND is None:
        from conveyor.worker.triton_backend import TritonAttentionBackend

        _TRITON_BACKEND = TritonAttentionBackend()
    return _TRITON_BACKEND
