"""Paged attention in plain torch: the CPU backend and the reference for every GPU kernel.

K/V live in a per-layer pool [num_blocks, 2, block_size, kv_heads, head_dim] (0 = K, 1 = V);
a sequence's context is the blocks of its block-table row, in order. Decodes (the first
ctx.num_decodes sequences, one query each) are attended in one batched computation; prefill
chunks, whose queries are the last q_len positions of their context, one sequence at a time.

An fp8 pool (float8 e4m3) holds K / k_scale and V / v_scale, clamped to +-448 (a saturating
cast); reads multiply by the scales: k_scale folds into the softmax scale, v_scale into the
output. A model-dtype pool has scales 1.0 (worker/kv_scales.py).

Per-layer options: a sliding window (a query sees its last `window` positions, itself
included; 0 = all) or chunked attention (Llama 4's: a query sees the positions of its
`chunk`-aligned chunk up to itself), logit soft-capping (scores become softcap *
tanh(scores / softcap) before the softmax; 0 = off), as Mistral's and Gemma's layers ask, and
attention sinks (gpt-oss's: a logit per head that joins each query's softmax denominator with
no value, so
out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink))).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.kernels._util import FP8_MAX
from conveyor.worker.context import StepContext
from conveyor.worker.kv_cache import FP8_DTYPE

# Up to this many decodes, SDPA on the gathered K/V beats per-head bmm on CPU (measured: 0.16 vs
# 0.30 ms at batch 2; 2.55 vs 2.20 ms at batch 32). A lone decode takes the per-sequence path.
_SDPA_MAX_DECODES = 8


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float8 e4m3, through float32, saturating at +-448."""
    # NOTE: times the float32 reciprocal, as the store_kv kernel does, so both round alike
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


class TorchAttentionBackend:
    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
                 ) -> None:
        """Store k, v [T, kv_heads, head_dim] at their slots (in an fp8 pool: divided by
        k_scale, v_scale); slot -1 (padding) is skipped.

        NOTE: the boolean mask makes a device sync on CUDA; GPU backends use a kernel instead.
        """
        nb, _, bs, kvh, d = kv_cache.shape
        if slot_mapping.device.type != "cpu" or bool((slot_mapping < 0).any()):
            keep = slot_mapping >= 0
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        # Row of slot s among the pool's [nb * 2 * bs] rows: block * 2 * bs + offset for K,
        # bs further for V; that is s + block * bs.
        rows = slot_mapping + slot_mapping // bs * bs
        flat = kv_cache.view(nb * 2 * bs, kvh, d)
        if kv_cache.dtype == FP8_DTYPE:   # CPU torch has no float8 index_copy_: copy the bytes
            flat = flat.view(torch.uint8)
            k = quantize_fp8(k, k_scale).view(torch.uint8)
            v = quantize_fp8(v, v_scale).view(torch.uint8)
        elif k_scale != 1.0 or v_scale != 1.0:
            raise ValueError(f"k_scale {k_scale} and v_scale {v_scale} need an fp8 cache, "
                             f"not {kv_cache.dtype}")
        flat.index_copy_(0, rows, k.to(flat.dtype))
        flat.index_copy_(0, rows + bs, v.to(flat.dtype))

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, ctx: StepContext,
                scale: float, k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None, chunk: int = 0
                ) -> torch.Tensor:
        """Attend q [T, heads, head_dim] to the pool (K and V times their scales); returns
        [T, heads, head_dim]. Rows past the last sequence (padding) come back as zeros.
        sinks: [heads] logits, or None.
        """
        scale = scale * k_scale            # q . (k_scale * k) = (scale * k_scale) q . k
        out = torch.zeros_like(q)
        nd = ctx.num_decodes if ctx.num_decodes > 1 else 0   # a lone decode: the plain path
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, ctx.block_tables[:nd], ctx.seq_lens[:nd],
                                    max(ctx.seq_lens_cpu[:nd]), scale, window, softcap,
                                    sinks, chunk)
        start = nd
        for i in range(nd, len(ctx.query_lens_cpu)):
            q_len, seq_len = ctx.query_lens_cpu[i], ctx.seq_lens_cpu[i]
            # keys before first are outside every query's window (or chunk: a chunk's start,
            # so that the kept keys' chunks are the sequence's)
            first = max(0, seq_len - q_len - window + 1) if window else 0
            if chunk:
                first = (seq_len - q_len) // chunk * chunk
            k, v = self._gather(kv_cache, ctx.block_tables[i:i + 1], seq_len)
            out[start:start + q_len] = self._prefill(q[start:start + q_len], k[0, first:seq_len],
                                                     v[0, first:seq_len], scale, window, softcap,
                                                     sinks, chunk)
            start += q_len
        return out if v_scale == 1.0 else out.mul_(v_scale)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int):
        """K and V of the first max_len positions, each [B, padded_len, kv_heads, head_dim].

        index_select of whole block rows: a memcpy per block, about twice as fast on CPU as
        advanced indexing, and its output is already in the [B, S, ...] layout.
        """
        nb, _, bs, kvh, d = kv_cache.shape
        num_blocks = -(-max_len // bs)
        blocks = block_tables[:, :num_blocks].reshape(-1).long()   # [B * n]
        b = block_tables.shape[0]
        fp8 = kv_cache.dtype == FP8_DTYPE
        raw = kv_cache.view(torch.uint8) if fp8 else kv_cache       # bytes: any device copies
        k = raw[:, 0].flatten(1).index_select(0, blocks)          # [B * n, bs * kvh * d]
        v = raw[:, 1].flatten(1).index_select(0, blocks)
        if fp8:
            k, v = k.view(FP8_DTYPE), v.view(FP8_DTYPE)
        return k.view(b, -1, kvh, d), v.view(b, -1, kvh, d)

    def _decode(self, q, kv_cache, block_tables, seq_lens, max_len, scale, window=0, softcap=0.0,
                sinks=None, chunk=0):
        k, v = self._gather(kv_cache, block_tables, max_len)  # [B, S, kvh, d]
        b, s, kvh, d = k.shape
        pos = torch.arange(s, device=q.device)
        pad = pos >= seq_lens.unsqueeze(1)                     # [B, S]
        if window:
            pad |= pos <= (seq_lens - 1 - window).unsqueeze(1)
        if chunk:
            pad |= pos < ((seq_lens - 1) // chunk * chunk).unsqueeze(1)
        if b <= _SDPA_MAX_DECODES and not softcap and sinks is None:   # one fused call
            # one query per sequence: the heads sharing a KV head are the rows of one query
            out = F.scaled_dot_product_attention(
                q.reshape(b, kvh, -1, d), k.transpose(1, 2).to(q.dtype),
                v.transpose(1, 2).to(q.dtype), attn_mask=~pad[:, None, None, :], scale=scale)
            return out.reshape(b, -1, d)                       # [B, heads, d]
        qg = q.float().reshape(b, kvh, -1, d)                  # [B, kvh, group, d]
        out = torch.empty_like(qg)                             # [B, kvh, group, d]
        group = qg.shape[2]
        # One kv head at a time: k[:, :, h] is a strided view that bmm reads without a copy.
        for h in range(kvh):
            scores = _capped(torch.bmm(qg[:, h], k[:, :, h].float().transpose(1, 2)) * scale,
                             softcap)
            scores.masked_fill_(pad.unsqueeze(1), float("-inf"))   # [B, group, S]
            sink = None if sinks is None else sinks[h * group:(h + 1) * group, None]
            out[:, h] = torch.bmm(_softmax(scores, sink), v[:, :, h].float())
        return out.view(b, -1, d).to(q.dtype)                  # [B, heads, d]

    @staticmethod
    def _prefill(q, k, v, scale, window=0, softcap=0.0, sinks=None, chunk=0):
        """q [L, heads, d] are the last L positions of a context k, v [S, kv_heads, d] (with a
        window, S may start later than the sequence: no query sees the keys cut off; with a
        chunk, at a chunk's start)."""
        q_len, seq_len = q.shape[0], k.shape[0]
        kvh, d = k.shape[1], k.shape[2]
        k = k.transpose(0, 1).unsqueeze(0).to(q.dtype)        # [1, kv_heads, S, d]
        v = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
        if softcap or sinks is not None:
            return _explicit_attention(q, k[0], v[0], scale, softcap, window, sinks, chunk)
        if q_len == 1:   # the last position sees everything; group rows share their KV head
            out = F.scaled_dot_product_attention(q.reshape(1, kvh, -1, d), k, v, scale=scale)
            return out.reshape(1, -1, d)                       # [1, heads, d]
        mask = None      # L == S: plain causal
        if q_len < seq_len or window or chunk:
            mask = _causal_mask(q_len, seq_len, window, q.device, chunk)
        # NOTE: SDPA's CPU kernels are several times faster on 4-D inputs than on 3-D ones.
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                             is_causal=mask is None, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)                          # [L, heads, d]


def _causal_mask(q_len: int, seq_len: int, window: int, device, chunk: int = 0
                 ) -> torch.Tensor:
    """[L, S] bool: query i (position S - L + i of the S keys) sees key j."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device)
    mask = j <= q_pos
    if window:
        mask &= j > q_pos - window
    if chunk:
        mask &= j >= q_pos // chunk * chunk
    return mask


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim, each row's sink logit (sinks broadcast to [..., 1]) in the
    denominator: the softmax over [scores, sink] with the sink's column dropped."""
    if sinks is None:
        return scores.softmax(-1)
    sinks = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]


def _explicit_attention(q, k, v, scale, softcap, window, sinks, chunk=0):
    """Attention in float32 with the scores in hand, for what SDPA cannot do (a soft cap,
    sinks [heads]): q [L, heads, d], k, v [kv_heads, S, d] -> [L, heads, d]."""
    q_len, heads, d = q.shape
    kvh, seq_len = k.shape[0], k.shape[1]
    qg = q.float().reshape(q_len, kvh, heads // kvh, d).permute(1, 0, 2, 3)   # [kvh, L, g, d]
    scores = torch.einsum("hlgd,hsd->hlgs", qg, k.float()) * scale
    scores = _capped(scores, softcap)
    mask = _causal_mask(q_len, seq_len, window, q.device, chunk)               # [L, S]
    scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
    sink = None if sinks is None else sinks.reshape(kvh, 1, heads // kvh, 1)
    out = torch.einsum("hlgs,hsd->hlgd", _softmax(scores, sink), v.float())
    return out.permute(1, 0, 2, 3).reshape(q_len, heads, d).to(q.dtype)
