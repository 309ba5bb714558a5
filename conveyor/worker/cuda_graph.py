"""CUDA graphs of the model's forward for decode-only steps, at a set of padded batch sizes.

Every graph reads the same static input buffers (token ids, positions, slots, context lengths,
block tables), so a step copies its inputs in and replays the graph of the smallest size that
holds its batch. Padding rows get slot -1 (no K/V written) and context length 0 (attention
reads nothing and returns zeros); their outputs are ignored. Prefill and mixed steps run eager.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from conveyor.worker.context import StepContext

_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448,
          512)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in _SIZES if s < max_batch]
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_batch: int,
                 max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.inputs = torch.zeros(4, n, dtype=torch.long, device=device)  # ids, pos, slot, len
        self.inputs[2].fill_(-1)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _context(self, bs: int) -> StepContext:
        return StepContext(slot_mapping=self.inputs[2, :bs],
                           query_start_loc=self.query_start_loc[:bs + 1],
                           seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
                           kv_caches=self.kv_caches, query_lens_cpu=[1] * bs,
                           seq_lens_cpu=[1] * bs, num_decodes=bs)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):            # largest first: the rest reuse its memory
            ctx = self._context(bs)
            self.model(self.inputs[0, :bs], self.inputs[1, :bs], ctx)   # warm-up (compiles)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(self.inputs[0, :bs], self.inputs[1, :bs], ctx)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode token per sequence; returns the final hidden states [n, hidden]."""
        n = len(input_ids)
        bs = next(s for s in self.sizes if s >= n)
        pad = bs - n
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad,
                             slot_mapping + [-1] * pad, seq_lens + [0] * pad], dtype=torch.long)
        self.inputs[:, :bs].copy_(host, non_blocking=True)
        self.seq_lens[:bs].copy_(self.inputs[3, :bs])
        width = max(len(t) for t in tables)
        padded = np.zeros((n, width), dtype=np.int32)
        for i, t in enumerate(tables):   # numpy fills rows several times faster than torch.tensor
            padded[i, :len(t)] = t
        self.block_tables[:n, :width].copy_(torch.from_numpy(padded))
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
