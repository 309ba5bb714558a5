"""Paged attention on the GPU through the Triton kernels: the same interface as
TorchAttentionBackend (write_kv, forward), with no host sync and no per-sequence loop, so it can
run inside a CUDA graph.
"""
from __future__ import annotations

import torch

from conveyor.kernels._util import num_sms
from conveyor.worker.context import StepContext

# steps of at most this many tokens split keys even when some sequence has several query tokens
# (speculative verification, a short prefill beside decodes): their grid has a few programs per
# KV head, too few to read a long context at the GPU's bandwidth
SPLIT_UP_TO_TOKENS = 64


class TritonAttentionBackend:
    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
                 ) -> None:
        from conveyor.kernels.store_kv import store_kv

        store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, ctx: StepContext,
                scale: float, k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None, chunk: int = 0
                ) -> torch.Tensor:
        """Attend q [T, heads, head_dim] to the pool; rows past the last sequence are zeros."""
        from conveyor.kernels.paged_attention import default_num_splits, paged_attention

        num_seqs = len(ctx.query_lens_cpu)
        decode_only = ctx.num_decodes == num_seqs
        tokens = num_seqs if decode_only else sum(ctx.query_lens_cpu)   # rows in use
        splits = 1
        if tokens <= SPLIT_UP_TO_TOKENS or decode_only:
            # few sequences: split each context so the grid fills the GPU
            splits = default_num_splits(num_seqs, kv_cache.shape[3], num_sms(q.device))
        out = paged_attention(q, kv_cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                              scale, 1 if decode_only else max(ctx.query_lens_cpu),
                              num_splits=splits, k_scale=k_scale, v_scale=v_scale,
                              seq_order=ctx.decode_order if decode_only else None,
                              window=window, softcap=softcap, sinks=sinks, chunk=chunk)
        if tokens < q.shape[0]:
            out[tokens:].zero_()
        return out
