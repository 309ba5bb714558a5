"""The model runner: turns a StepPlan into one forward pass and a StepResult.

It keeps a mirror of every running sequence in a slot (its tokens, block table, sampling state),
updated by the plan's deltas, so a step message carries only small integers. The same code runs
on CPU and GPU; only rank 0's result is used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.shared.config import EngineConfig, ModelConfig
from conveyor.shared.messages import StepPlan, StepResult
from conveyor.shared.model_files import ModelFiles
from conveyor.shared.sampling_params import SamplingParams
from conveyor.worker.context import StepContext
from conveyor.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for_budget
from conveyor.worker.loader import load_model
from conveyor.worker.sampler import Sampler, SeqSamplingState

_PROFILE_PARAMS = SamplingParams(temperature=0)


@dataclass
class Slot:
    block_ids: list[int]
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
        self.num_blocks = self._num_blocks()
        self.kv_caches = allocate_kv_cache(model_config, config, self.num_blocks, self.dtype,
                                           self.device)
        self.slots: dict[int, Slot] = {}

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
        saved, self.kv_caches = getattr(self, "kv_caches", None), allocate_kv_cache(
            self.model_config, self.config, blocks, self.dtype, self.device)
        self.slots = {0: Slot(list(range(blocks)), 0,
                              SeqSamplingState.new(_PROFILE_PARAMS, [0] * num_tokens, num_tokens,
                                                   self.device))}
        self._forward([(0, num_tokens, True, -1)], logits_rows=self.config.max_num_seqs)
        self.slots, self.kv_caches = {}, saved
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
            self.slots[seq.slot] = Slot(list(seq.block_ids), seq.num_computed, state)
        steps = []
        for s in plan.seqs:
            self.slots[s.slot].block_ids.extend(s.new_block_ids)
            steps.append((s.slot, s.num_tokens, s.sample, s.prompt_logprobs_from))
        if not steps:
            return StepResult(step=plan.step, sampled=[], logprobs=[], prompt_logprobs=[])
        return self._forward(steps, step=plan.step)

    def _forward(self, steps: list[tuple[int, int, bool, int]], step: int = 0,
                 logits_rows: int = 0) -> StepResult:
        """steps: (slot, num_tokens, sample, prompt_logprobs_from) in batch order."""
        bs = self.block_size
        input_ids, positions, slot_mapping = [], [], []
        query_lens, seq_lens, tables = [], [], []
        sample_rows, sample_states = [], []
        prompt_rows: list[tuple[int, list[int], list[int], int]] = []  # slot, rows, targets, k
        num_decodes, decodes_done = 0, False
        for slot_id, n, sample, lp_from in steps:
            slot = self.slots[slot_id]
            start, end = slot.num_computed, slot.num_computed + n
            tokens = slot.state.token_ids
            row0 = len(input_ids)
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            table = slot.block_ids
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(table)
            if n == 1 and not decodes_done:
                num_decodes += 1
            else:
                decodes_done = True
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

        ctx = self._context(slot_mapping, query_lens, seq_lens, tables, num_decodes)
        dev = self.device
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), ctx)
        if logits_rows:  # profiling: the largest logits tensor a step can make
            self.model.compute_logits(hidden[-1:].expand(logits_rows, -1))
            return StepResult(step=step, sampled=[], logprobs=[], prompt_logprobs=[])

        rows = sample_rows + [r for _, rs, _, _ in prompt_rows for r in rs]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)]) if rows else None
        out = self.sampler.sample(logits[:len(sample_rows)], sample_states) if sample_rows else None
        sampled = out.token_ids if out else []
        for state, token in zip(sample_states, sampled):
            state.token_ids.append(token)
        prompt_logprobs, offset = [], len(sample_rows)
        for slot_id, rs, targets, k in prompt_rows:
            part = logits[offset:offset + len(rs)]
            prompt_logprobs.append((slot_id, self.sampler.prompt_logprobs(part, targets, k)))
            offset += len(rs)
        return StepResult(step=step, sampled=sampled, logprobs=out.logprobs if out else [],
                          prompt_logprobs=prompt_logprobs)

    def _context(self, slot_mapping, query_lens, seq_lens, tables, num_decodes) -> StepContext:
        dev = self.device
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return StepContext(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            kv_caches=self.kv_caches,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            num_decodes=num_decodes,
        )

