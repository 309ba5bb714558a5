"""The per-step inputs of attention, built by the model runner and passed explicitly to the model.

A batch is flat: the new tokens of every sequence back to back (no padding between sequences).
Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; those are its last query
positions: its context after this step is seq_lens[i] tokens, all of them in the KV pool once the
new K/V are written at slot_mapping.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepContext:
    slot_mapping: torch.Tensor       # [T] int64: block_id * block_size + offset; -1 skips
    query_start_loc: torch.Tensor    # [B + 1] int32
    seq_lens: torch.Tensor           # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor       # [B, max_blocks] int32, padded with 0
    kv_caches: list[torch.Tensor]    # per layer: [num_blocks, 2, block_size, kv_heads, head_dim]
    query_lens_cpu: list[int]        # host copies, so the torch backend never syncs the device
    seq_lens_cpu: list[int]
    num_decodes: int = 0             # the first num_decodes sequences have one query token each
    decode_order: torch.Tensor | None = None   # [B] int32, decode-only steps: the sequences by
                                               # context length, longest first (attention's order)
    # [T, 1, 1] float32, set by the model for its layers: each query token's factor (Llama 4's
    # attention temperature by position, models/llama.py's query_temperature; the attention
    # modules multiply their queries by it); None: 1
    q_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.kv_caches[0].shape[2]
