"""The paged KV pool: one tensor per layer, [num_blocks, 2, block_size, kv_heads, head_dim].

Block ids are the scheduler's; every rank holds its own KV heads of every block, for the layers
of its pipeline stage (all of them without pipeline parallelism), so a stage of L / P layers
fits P times the blocks in the same bytes. On CPU the pool
is sized from a byte budget; on GPU from the memory left after profiling a forward pass. With
`kv_cache_dtype="fp8"` the pool is float8 e4m3 (one byte an element: twice the blocks for the
same bytes); K and V are stored divided by per-layer scales (worker/kv_scales.py).
"""
from __future__ import annotations

import torch

from conveyor.shared.config import EngineConfig
from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.parallel import tp_size
from conveyor.worker.layers.pipeline import stage

FP8_DTYPE = torch.float8_e4m3fn


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type: float8 e4m3, or the model's own dtype ("auto")."""
    return FP8_DTYPE if config.kv_cache_fp8 else model_dtype


def kv_heads_per_rank(model: ModelConfig) -> int:
    """The KV heads this rank holds (its tensor-parallel group's share, as its attention
    layers have). NOTE: with more ranks than KV heads, each is replicated on several ranks."""
    return max(1, model.num_key_value_heads // tp_size())


def bytes_per_block(model: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    per_layer = 2 * config.block_size * kv_heads_per_rank(model)
    per_layer *= model.head_dim * torch.empty((), dtype=dtype).element_size()
    return per_layer * len(stage().layers(model.num_hidden_layers))


def num_blocks_for_budget(model: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                          budget_bytes: int) -> int:
    return budget_bytes // bytes_per_block(model, config, dtype)


def allocate_kv_cache(model: ModelConfig, config: EngineConfig, num_blocks: int,
                      dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    shape = (num_blocks, 2, config.block_size, kv_heads_per_rank(model), model.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device)
            for _ in stage().layers(model.num_hidden_layers)]
