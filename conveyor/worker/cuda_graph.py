"""CUDA graphs of the model's forward, so a step costs one replay on the host, not ~400 launches.

Two families, captured at padded shapes, read the same static input buffers (token ids,
positions, slots, context lengths, block tables); a step copies its inputs in and replays the
smallest graph that holds it:
- decode graphs, by batch size: one token a sequence, attention's decode grid (sequences by
  context length, split KV when few);
- mixed graphs, by token count, with room for max_num_seqs sequences: any mix of decodes and
  prefill chunks (attention's flat tile grid sizes itself from the token and sequence counts,
  so it needs no host-side numbers of the step).
Padding tokens get slot -1 (no K/V written); padding sequences have no tokens and context length
0, so attention does nothing for them; the outputs of padding rows are ignored. With LoRA the
graphs also read each token's adapter slot and the tokens grouped by slot (static buffers too),
and launch the LoRA kernels whatever the step's adapters: a slot with no tokens costs programs
that return at once. Steps larger than
the largest mixed graph, and the profiling step, run eagerly.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.worker.context import StepContext
from conveyor.worker.layers.lora import LoRABatch

_DECODE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
                 448, 512)
# Mixed steps: padding costs GPU time in proportion to the tokens, so the sizes get finer in
# relative terms as steps grow (at most 1/2 extra below 256 tokens, 1/8 above 1024).
_MIXED_SIZES = (16, 32, 64, 128, *range(256, 2048, 128), *range(2048, 16385, 256))


def graph_sizes(sizes: tuple[int, ...], largest: int) -> list[int]:
    return [s for s in sizes if s < largest] + [largest]


@dataclass(frozen=True)
class GraphShape:
    tokens: int       # rows of the padded batch
    seqs: int         # sequences of the padded batch
    decode: bool      # a decode graph (else mixed)


class StepGraphs:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_decode_batch: int,
                 max_seqs: int, max_mixed_tokens: int, max_blocks_per_seq: int,
                 device: torch.device, lora=None):
        """lora: the model's LoRAManager (worker/lora.py), or None."""
        self.model = model
        self.kv_caches = kv_caches
        self.decode_sizes = graph_sizes(_DECODE_SIZES, max_decode_batch)
        self.mixed_sizes = graph_sizes(_MIXED_SIZES, max_mixed_tokens) if max_mixed_tokens else []
        self.max_seqs = max(max_seqs, self.decode_sizes[-1])
        rows = max(self.decode_sizes[-1], max_mixed_tokens)
        self.lora = lora
        # ids, positions, KV slots (and with LoRA adapter slots)
        self.inputs = torch.zeros(3 if lora is None else 4, rows, dtype=torch.long,
                                  device=device)
        self.inputs[2:].fill_(-1)
        if lora is not None:
            self.lora_order = torch.zeros(rows, dtype=torch.long, device=device)
            self.lora_starts = torch.zeros(lora.num_slots + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(self.max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=device)
        self.decode_starts = torch.arange(self.max_seqs + 1, dtype=torch.int32, device=device)
        self.order = torch.arange(self.max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_seqs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphShape, torch.Tensor] = {}
        self._capture()

    def pick(self, num_seqs: int, num_tokens: int) -> GraphShape | None:
        """The graph that runs a step of num_tokens tokens over num_seqs sequences (a decode
        graph when every sequence has one token); None: run it eagerly."""
        if num_tokens == num_seqs and num_seqs <= self.decode_sizes[-1]:
            bs = next(s for s in self.decode_sizes if s >= num_seqs)
            return GraphShape(bs, bs, True)
        if self.mixed_sizes and num_tokens <= self.mixed_sizes[-1]:
            t = next(s for s in self.mixed_sizes if s >= num_tokens)
            return GraphShape(t, self.max_seqs, False)
        return None

    def _context(self, g: GraphShape) -> StepContext:
        # NOTE: the attention backend reads only the count of the host lists and their maximum
        # (the tile shape): a decode graph has bs one-token sequences; a mixed graph sizes its
        # tiles for queries of any length up to its token count.
        starts = self.decode_starts if g.decode else self.query_start_loc
        query_lens = [1] * g.seqs if g.decode else [g.tokens] + [0] * (g.seqs - 1)
        return StepContext(slot_mapping=self.inputs[2, :g.tokens],
                           query_start_loc=starts[:g.seqs + 1], seq_lens=self.seq_lens[:g.seqs],
                           block_tables=self.block_tables[:g.seqs], kv_caches=self.kv_caches,
                           query_lens_cpu=query_lens, seq_lens_cpu=query_lens,
                           num_decodes=g.seqs if g.decode else 0,
                           decode_order=self.order[:g.seqs] if g.decode else None)

    @torch.inference_mode()
    def _capture(self) -> None:
        shapes = ([GraphShape(t, self.max_seqs, False) for t in self.mixed_sizes]
                  + [GraphShape(bs, bs, True) for bs in self.decode_sizes])
        pool = None
        # largest first, each family: the rest reuse its memory (one pool for all)
        for g in sorted(shapes, key=lambda g: (g.decode, -g.tokens)):
            ctx = self._context(g)
            ids, positions = self.inputs[0, :g.tokens], self.inputs[1, :g.tokens]
            with self._lora_step(g):
                self.model(ids, positions, ctx)                  # warm-up (compiles)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[g] = self.model(ids, positions, ctx)
            pool = graph.pool()
            self.graphs[g] = graph
        torch.cuda.synchronize()

    def _lora_step(self, g: GraphShape):
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.state.step(LoRABatch(self.inputs[3, :g.tokens],
                                              self.lora_order[:g.tokens], self.lora_starts, None))

    def run(self, g: GraphShape, num_seqs: int, step: dict[str, torch.Tensor],
            block_tables: torch.Tensor) -> torch.Tensor:
        """Replay graph g for a step of num_seqs sequences; returns the final hidden states of
        its g.tokens rows (rows past the step's tokens are padding).

        step: StepInputs.build's tensors, padded to g (tokens [3, g.tokens], seq_lens and order
        [g.seqs], query_start_loc [g.seqs + 1]) and slots [num_seqs], the step's rows of
        block_tables. All on the device.
        """
        self.inputs[:, :g.tokens].copy_(step["tokens"])
        if self.lora is not None:
            self.lora_order[:g.tokens].copy_(step["lora_order"])
            self.lora_starts.copy_(step["lora_starts"])
        self.seq_lens[:g.seqs].copy_(step["seq_lens"])
        if g.decode:
            self.order[:g.seqs].copy_(step["order"])
        else:
            self.query_start_loc[:g.seqs + 1].copy_(step["query_start_loc"])
        torch.index_select(block_tables, 0, step["slots"], out=self.block_tables[:num_seqs])
        self.graphs[g].replay()
        return self.outputs[g]
