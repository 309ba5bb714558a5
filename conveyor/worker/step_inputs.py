"""A step's integer inputs: built with numpy on the host, sent to the device in one copy.

`StepInputs` also holds the block tables, one [max_num_seqs, max_blocks_per_seq] table on the
host and its mirror on the device. New entries are set on the host at once and reach the device
with the next step's inputs, so a step writes only the entries it added.
"""
from __future__ import annotations

import numpy as np
import torch

from conveyor.worker.context import StepContext


class StepInputs:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.device = device
        self.table_host = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        # flat index -> block id, to copy with the next step's inputs. NOTE: one entry an index,
        # the last set: a draft's scratch entries are reset and the step's new blocks set at the
        # same places before one copy, and index_put_ on CUDA writes duplicates in no set order.
        self._writes: dict[int, int] = {}
        # host side of the one copy per step: two buffers in turn, each with an event recorded
        # after its last copy (CUDA)
        self._staging = [torch.empty(0, dtype=torch.long) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def add_blocks(self, slot: int, first: int, block_ids: list[int]) -> None:
        """Set entries first, first + 1, ... of block-table row `slot`."""
        self.table_host[slot, first:first + len(block_ids)] = block_ids
        at = slot * self.table_host.shape[1] + first
        self._writes.update(zip(range(at, at + len(block_ids)), block_ids))

    def build(self, slots: list[int], input_ids: list[int], starts: list[int],
              query_lens: list[int], seq_lens: list[int], logits_rows: list[int],
              padded_tokens: int, padded_seqs: int, gather_rows: list[int], gather_from: list[int],
              draw: torch.Tensor | None, lora_slots: list[int] | None = None,
              num_lora_slots: int = 0) -> dict[str, torch.Tensor]:
        """A step's inputs on the device, made from its numbers per sequence (in batch order:
        block-table row, first position, number of new tokens, context length) and its new token
        ids back to back (T of them).

        Returns (int64): tokens [3, padded_tokens] (ids, positions, KV slots; rows past T pad a
        CUDA graph's batch: 0, 0, -1), seq_lens [padded_seqs] (padding 0), order [padded_seqs]
        for a decode-only step (the rows of seq_lens, longest first; else empty),
        query_start_loc [padded_seqs + 1] (padding sequences start and end at T), slots [B],
        rows [R] (hidden rows to compute logits for), gather_rows and gather_from [G] (token-id
        rows that take rows of `draw`, the previous step's sampled tokens, and those rows). The
        block-table entries added since the last step are written.

        With LoRA (lora_slots: each sequence's adapter slot, -1: none) tokens has a fourth row,
        each token's slot (padding -1), and lora_order [padded_tokens] and lora_starts
        [num_lora_slots + 1] group the token rows by slot (kernels/lora.py group_by_slot).
        """
        bs, num_seqs, num_tokens = self.block_size, len(slots), len(input_ids)
        slot_ids, n = np.asarray(slots, dtype=np.int64), np.asarray(query_lens, dtype=np.int64)
        query_start_loc = np.full(padded_seqs + 1, num_tokens, dtype=np.int64)
        query_start_loc[0] = 0
        np.cumsum(n, out=query_start_loc[1:num_seqs + 1])
        # [T] each token's block-table row and position
        if num_tokens == num_seqs:                  # one token each: decodes
            seq_of, positions = slot_ids, np.asarray(starts, dtype=np.int64)
        else:
            seq_of = np.repeat(slot_ids, n)
            positions = np.arange(num_tokens) - np.repeat(query_start_loc[:num_seqs] - starts, n)
        rows = 3 if lora_slots is None else 4
        tokens = np.zeros((rows, padded_tokens), dtype=np.int64)   # ids, positions, KV slots
        tokens[0, :num_tokens] = input_ids
        tokens[1, :num_tokens] = positions
        tokens[2, :num_tokens] = self.table_host[seq_of, positions // bs] * bs + positions % bs
        tokens[2, num_tokens:] = -1
        lora = {}
        if lora_slots is not None:                                 # adapter slot of each token
            from conveyor.kernels.lora import group_by_slot

            tokens[3, num_tokens:] = -1
            tokens[3, :num_tokens] = (np.asarray(lora_slots, dtype=np.int64)
                                      if num_tokens == num_seqs else np.repeat(lora_slots, n))
            order, starts = group_by_slot(tokens[3], num_lora_slots)
            lora = {"lora_order": order, "lora_starts": starts}
        lens = np.zeros(padded_seqs, dtype=np.int64)
        lens[:num_seqs] = seq_lens
        writes, self._writes = self._writes, {}
        out = self._send({
            "tokens": tokens, "seq_lens": lens,
            "order": np.argsort(-lens, kind="stable") if num_tokens == num_seqs else (),
            "query_start_loc": query_start_loc, "slots": slot_ids, "rows": logits_rows,
            "gather_rows": gather_rows, "gather_from": gather_from,
            "write_at": list(writes), "write_ids": list(writes.values()), **lora})
        out["tokens"] = out["tokens"].view(rows, padded_tokens)
        if gather_rows:
            out["tokens"][0].index_copy_(0, out["gather_rows"],
                                         draw.index_select(0, out["gather_from"]))
        if writes:
            self.block_tables.view(-1)[out["write_at"]] = out["write_ids"].int()
        return out

    def context(self, dev: dict[str, torch.Tensor], kv_caches: list[torch.Tensor],
                query_lens: list[int], seq_lens: list[int]) -> StepContext:
        """The attention context of an eager step from build's tensors (its decodes first)."""
        num_seqs = len(query_lens)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), num_seqs)
        return StepContext(
            slot_mapping=dev["tokens"][2], query_start_loc=dev["query_start_loc"].int(),
            seq_lens=dev["seq_lens"].int(),
            block_tables=self.block_tables.index_select(0, dev["slots"]), kv_caches=kv_caches,
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, num_decodes=num_decodes,
            decode_order=dev["order"].int() if num_decodes == num_seqs else None)

    def _send(self, pieces: dict[str, object]) -> dict[str, torch.Tensor]:
        """Lay the pieces (integer arrays or lists) back to back in a host staging buffer, copy
        it to the device in one non-blocking copy, and return each piece's (flat) view there."""
        arrays = [np.asarray(p, dtype=np.int64).ravel() for p in pieces.values()]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        # NOTE: with a step in flight the buffer of the last step may still be copying: the two
        # buffers take turns, and a buffer is rewritten only once its last copy ran (its event;
        # that copy came before the previous step's sampling, which the host waited for, so
        # this never waits in practice).
        turn, self._turn = self._turn, self._turn ^ 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        if self._staging[turn].numel() < total:
            self._staging[turn] = torch.empty(max(total, 2 * self._staging[turn].numel()),
                                              dtype=torch.long,
                                              pin_memory=self.device.type == "cuda")
        staging = self._staging[turn][:total]
        np.concatenate(arrays, out=staging.numpy())
        flat = staging.to(self.device, non_blocking=True)   # on CPU: staging itself
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        return dict(zip(pieces, flat.split(sizes)))
