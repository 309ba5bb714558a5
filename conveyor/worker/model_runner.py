"""The model runner: turns a StepPlan into one forward pass and a StepResult.

It keeps a mirror of every running sequence in a slot (its tokens, block table, sampling state),
updated by the plan's deltas, so a step message carries only small integers. The block tables
live in one [max_num_seqs, max_blocks_per_seq] table, on the host (numpy) and on the device; a
step writes only the entries it added. A step's integer inputs are built with numpy from per-
sequence numbers and reach the device in one copy. The same code runs on CPU and GPU; only rank
0's result is used.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.shared.config import EngineConfig, ModelConfig
from conveyor.shared.messages import StepPlan, StepResult
from conveyor.shared.model_files import ModelFiles
from conveyor.shared.sampling_params import SamplingParams
from conveyor.worker.context import StepContext
from conveyor.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for_budget
from conveyor.worker.layers.parallel import broadcast_from_rank0, min_over_ranks, tp_rank
from conveyor.worker.loader import load_model
from conveyor.worker.sampler import Sampler, SeqSamplingState

_PROFILE_PARAMS = SamplingParams(temperature=0)


@dataclass
class Slot:
    num_blocks: int                  # entries of its row of the block table in use
    num_computed: int
    state: SeqSamplingState          # holds the token ids (prompt + output so far)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, files: ModelFiles,
                 max_model_len: int, device: torch.device | None = None):
        self.config = config
        self.model_config = model_config
        self.device = device or torch.device(config.device)
        self.dtype = getattr(torch, config.torch_dtype_name)
        torch.manual_seed(config.seed)
        self.model = load_model(model_config, files, self.dtype, self.device)
        self.sampler = Sampler(model_config.vocab_size, model_config.eos_token_ids, config.seed,
                               self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.graphs = None      # CUDA graphs of decode-only steps, made once the pool exists
        max_blocks = -(-max_model_len // self.block_size)
        self.table_host = np.zeros((config.max_num_seqs, max_blocks), dtype=np.int32)
        self.block_tables = torch.zeros(config.max_num_seqs, max_blocks, dtype=torch.int32,
                                        device=self.device)
        self._table_writes: list[tuple[int, list[int]]] = []   # (flat index, block ids) to copy
        self._staging = torch.empty(0, dtype=torch.long)        # host side of the one copy
        self.num_blocks = min_over_ranks(self._num_blocks(), self.device)
        self.kv_caches = allocate_kv_cache(model_config, config, self.num_blocks, self.dtype,
                                           self.device)
        self.slots: dict[int, Slot] = {}
        if self.device.type == "cuda" and not config.enforce_eager:
            from conveyor.worker.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_caches, min(config.max_num_seqs, 512),
                                       max_blocks, self.device)

    # --- sizing -------------------------------------------------------------------------------

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cpu":
            # NOTE: more blocks than every sequence at full length could use only feed the prefix
            # cache; on CPU the budget is capped there so small models don't zero gigabytes.
            enough = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
            return min(enough, num_blocks_for_budget(self.model_config, self.config, self.dtype,
                                                     self.config.kv_cache_memory_bytes))
        return self._profile_gpu_blocks()

    def _profile_gpu_blocks(self) -> int:
        """Run the largest step once and give the KV pool what is left of the memory budget."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        # NOTE: runs before the real pool exists: a pool just big enough for this one step
        self.kv_caches = allocate_kv_cache(self.model_config, self.config, blocks, self.dtype,
                                           self.device)
        self.slots = {0: Slot(0, 0, SeqSamplingState.new(_PROFILE_PARAMS, [0] * num_tokens,
                                                         num_tokens, self.device))}
        self._add_blocks(0, list(range(blocks)))
        self._forward([(0, num_tokens, True, -1)], logits_rows=self.config.max_num_seqs)
        self.slots, self.kv_caches = {}, []
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_bytes = int(total * self.config.gpu_memory_utilization) - peak
        num = free_bytes // bytes_per_block(self.model_config, self.config, self.dtype)
        if num < 1:
            raise RuntimeError(f"no memory left for the KV cache: peak {peak / 2**30:.1f} GiB of "
                               f"{total / 2**30:.1f} GiB; raise gpu_memory_utilization or lower "
                               f"max_num_batched_tokens")
        torch.cuda.empty_cache()
        return num

    # --- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        for slot in plan.freed:
            self.slots.pop(slot, None)
        for seq in plan.new:
            state = SeqSamplingState.new(seq.sampling, list(seq.token_ids), seq.prompt_len,
                                         self.device)
            self.slots[seq.slot] = Slot(0, seq.num_computed, state)
            self._add_blocks(seq.slot, seq.block_ids)
        steps = []
        for s in plan.seqs:
            if s.new_block_ids:
                self._add_blocks(s.slot, s.new_block_ids)
            steps.append((s.slot, s.num_tokens, s.sample, s.prompt_logprobs_from))
        if not steps:
            return StepResult(step=plan.step, sampled=[], logprobs=[], prompt_logprobs=[])
        return self._forward(steps, step=plan.step)

    def _add_blocks(self, slot_id: int, block_ids: list[int]) -> None:
        slot = self.slots[slot_id]
        n = slot.num_blocks
        self.table_host[slot_id, n:n + len(block_ids)] = block_ids
        self._table_writes.append((slot_id * self.table_host.shape[1] + n, block_ids))
        slot.num_blocks = n + len(block_ids)

    def _forward(self, steps: list[tuple[int, int, bool, int]], step: int = 0,
                 logits_rows: int = 0) -> StepResult:
        """steps: (slot, num_tokens, sample, prompt_logprobs_from) in batch order."""
        input_ids: list[int] = []
        starts, query_lens, seq_lens = [], [], []
        sample_rows, sample_states = [], []
        prompt_rows: list[tuple[int, list[int], list[int], int]] = []  # slot, rows, targets, k
        num_decodes, decodes_done = 0, False
        for slot_id, n, sample, lp_from in steps:
            slot = self.slots[slot_id]
            start, end = slot.num_computed, slot.num_computed + n
            tokens = slot.state.token_ids
            row0 = len(input_ids)
            if n == 1:
                input_ids.append(tokens[start])
                if not decodes_done:
                    num_decodes += 1
            else:
                input_ids.extend(tokens[start:end])
                decodes_done = True
            starts.append(start)
            query_lens.append(n)
            seq_lens.append(end)
            if sample:
                sample_rows.append(row0 + n - 1)
                sample_states.append(slot.state)
            if lp_from >= 0:
                # position p is predicted by the row of position p - 1
                first = max(lp_from, start + 1)
                last = min(end + 1, slot.state.prompt_len)
                if first < last:
                    rows = [row0 + p - 1 - start for p in range(first, last)]
                    prompt_rows.append((slot_id, rows, tokens[first:last],
                                        slot.state.params.prompt_logprobs))
            slot.num_computed = end

        num_seqs, num_tokens = len(steps), len(input_ids)
        graphs = self.graphs
        use_graph = (graphs is not None and num_decodes == num_seqs and not logits_rows
                     and num_decodes <= graphs.max_batch)
        padded = graphs.size_for(num_seqs) if use_graph else num_tokens   # graph rows
        rows = sample_rows + [r for _, rs, _, _ in prompt_rows for r in rs]
        dev = self._to_device(steps, input_ids, starts, query_lens, seq_lens, rows, padded)
        tokens3 = dev["tokens"]                                    # [3, padded]: ids, pos, slot
        if use_graph:
            hidden = graphs.run(num_seqs, tokens3, dev["seq_lens"], self.block_tables,
                                dev["slots"])
        else:
            ctx = StepContext(
                slot_mapping=tokens3[2], query_start_loc=dev["query_start_loc"].int(),
                seq_lens=dev["seq_lens"].int(),
                block_tables=self.block_tables.index_select(0, dev["slots"]),
                kv_caches=self.kv_caches, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
                num_decodes=num_decodes)
            hidden = self.model(tokens3[0], tokens3[1], ctx)
        if logits_rows:  # profiling: the largest logits tensor a step can make
            self.model.compute_logits(hidden[-1:].expand(logits_rows, -1))
            return StepResult(step=step, sampled=[], logprobs=[], prompt_logprobs=[])

        logits = self.model.compute_logits(hidden[dev["rows"]]) if rows else None
        # NOTE: only rank 0 samples; the others take its tokens so their slots stay in step.
        out = (self.sampler.sample(logits[:len(sample_rows)], sample_states)
               if sample_rows and tp_rank() == 0 else None)
        sampled = broadcast_from_rank0(out.token_ids if out else [0] * len(sample_rows),
                                       self.device)
        for state, token in zip(sample_states, sampled):
            state.token_ids.append(token)
        prompt_logprobs, offset = [], len(sample_rows)
        for slot_id, rs, targets, k in prompt_rows:
            part = logits[offset:offset + len(rs)]
            prompt_logprobs.append((slot_id, self.sampler.prompt_logprobs(part, targets, k)))
            offset += len(rs)
        return StepResult(step=step, sampled=sampled, logprobs=out.logprobs if out else [],
                          prompt_logprobs=prompt_logprobs)

    def _to_device(self, steps, input_ids, starts, query_lens, seq_lens, rows,
                   padded: int) -> dict[str, torch.Tensor]:
        """The step's integer inputs, built with numpy and sent to the device in one copy.

        tokens [3, padded] (token ids, positions, KV slots; padding rows: 0, 0, -1), seq_lens
        [max(padded, B)] (padding 0), query_start_loc [B + 1], slots [B] (block-table rows),
        rows [R] (hidden rows to compute logits for); and the block-table entries added since
        the last step, written into the device table.
        """
        bs = self.block_size
        num_seqs, num_tokens = len(steps), len(input_ids)
        slot_ids = np.fromiter((s[0] for s in steps), dtype=np.int64, count=num_seqs)
        start = np.asarray(starts, dtype=np.int64)
        if num_tokens == num_seqs:              # one token each: decodes
            seq_of, positions = slot_ids, start
        else:
            n = np.asarray(query_lens, dtype=np.int64)
            seq_start = np.repeat(np.cumsum(n) - n - start, n)     # row of position 0, per token
            seq_of = np.repeat(slot_ids, n)
            positions = np.arange(num_tokens, dtype=np.int64) - seq_start
        writes, self._table_writes = self._table_writes, []
        write_len = sum(len(b) for _, b in writes)
        b_pad = num_seqs + padded - num_tokens
        sizes = {"tokens": 3 * padded, "seq_lens": b_pad, "query_start_loc": num_seqs + 1,
                 "slots": num_seqs, "rows": len(rows), "write_at": write_len,
                 "write_ids": write_len}
        total = sum(sizes.values())
        if self._staging.numel() < total:
            self._staging = torch.empty(max(total, 2 * self._staging.numel()), dtype=torch.long,
                                        pin_memory=self.device.type == "cuda")
        # NOTE: the staging buffer is rewritten next step; safe because every step ends with a
        # sync (the sampled tokens' .tolist()) after this copy has run.
        host = self._staging.numpy()[:total]
        tokens = host[:3 * padded].reshape(3, padded)
        tokens[0, :num_tokens] = input_ids
        tokens[1, :num_tokens] = positions
        tokens[2, :num_tokens] = (self.table_host[seq_of, positions // bs] * bs
                                  + positions % bs)
        tokens[:2, num_tokens:] = 0
        tokens[2, num_tokens:] = -1
        at = 3 * padded
        host[at:at + num_seqs] = seq_lens
        host[at + num_seqs:at + b_pad] = 0
        at += b_pad
        host[at] = 0
        np.cumsum(query_lens, out=host[at + 1:at + num_seqs + 1])
        at += num_seqs + 1
        host[at:at + num_seqs] = slot_ids
        at += num_seqs
        host[at:at + len(rows)] = rows
        at += len(rows)
        if writes:
            host[at:at + write_len] = np.concatenate(
                [np.arange(i, i + len(b)) for i, b in writes])
            host[at + write_len:at + 2 * write_len] = np.concatenate([b for _, b in writes])
        flat = self._staging[:total].to(self.device, non_blocking=True)
        out, at = {}, 0
        for name, size in sizes.items():
            out[name] = flat[at:at + size]
            at += size
        out["tokens"] = out["tokens"].view(3, padded)
        if writes:
            self.block_tables.view(-1)[out["write_at"]] = out["write_ids"].int()
        return out
