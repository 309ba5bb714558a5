"""CUDA graphs of the model's forward for decode-only steps, at a set of padded batch sizes.

Every graph reads the same static input buffers (token ids, positions, slots, context lengths,
block tables), so a step copies its inputs in and replays the graph of the smallest size that
holds its batch. Padding rows get slot -1 (no K/V written) and context length 0 (attention
reads nothing and returns zeros); their outputs are ignored. Prefill and mixed steps run eager.
"""
from __future__ import annotations

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
        self.inputs = torch.zeros(3, n, dtype=torch.long, device=device)  # ids, pos, slot
        self.inputs[2].fill_(-1)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.order = torch.arange(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _context(self, bs: int) -> StepContext:
        return StepContext(slot_mapping=self.inputs[2, :bs],
                           query_start_loc=self.query_start_loc[:bs + 1],
                           seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
                           kv_caches=self.kv_caches, query_lens_cpu=[1] * bs,
                           seq_lens_cpu=[1] * bs, num_decodes=bs,
                           decode_order=self.order[:bs])

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

    def size_for(self, n: int) -> int:
        """The smallest captured batch size that holds n sequences."""
        return next(s for s in self.sizes if s >= n)

    def run(self, n: int, tokens: torch.Tensor, seq_lens: torch.Tensor, order: torch.Tensor,
            block_tables: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
        """One decode token for each of n sequences; returns the final hidden states [n, hidden].

        tokens [3, bs] (ids, positions, slots), seq_lens [bs] and order [bs] (the rows by
        context length, longest first) are already padded to the graph size bs; the block
        tables are rows table_rows [n] of block_tables. All on the device.
        """
        bs = self.size_for(n)
        self.inputs[:, :bs].copy_(tokens)
        self.seq_lens[:bs].copy_(seq_lens)
        self.order[:bs].copy_(order)
        torch.index_select(block_tables, 0, table_rows, out=self.block_tables[:n])
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
