"""The model runner: turns a StepPlan into one forward pass and a StepResult.

It keeps a mirror of every running sequence in a slot (its tokens, block table, sampling state),
updated by the plan's deltas, so a step message carries only small integers. A step's integer
inputs (and the block tables' new entries) reach the device in one copy, built by `StepInputs`
from per-sequence numbers. The same code runs on CPU and GPU; only rank 0's result is used.

Steps are pipelined: `submit` queues a plan's forward pass before it takes the previous step's
result, so the host never makes the device wait; a decode whose input is the token the previous
step sampled gets it on the device. `execute` runs one step to its end. A launched step's draw
(sampling or verifying guesses, the copies to the host, reading them back) is worker/draw.py's.

Under pipeline parallelism a runner is one stage (layers/pipeline.py): it runs its layers on the
previous stage's activations and hands its own to the next; only the last stage samples, and
the other stages learn the drawn tokens from the plans (SeqStep.token_ids). Stages run each
plan to its end (`execute`) and eagerly (no CUDA graphs).
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch

from conveyor.shared.config import EngineConfig
from conveyor.shared.lora import LoRARequest
from conveyor.shared.messages.worker import StepPlan, StepResult
from conveyor.shared.model_config import ModelConfig
from conveyor.shared.model_files import ModelFiles
from conveyor.shared.sampling_params import SamplingParams
from conveyor.worker.context import StepContext
from conveyor.worker.draw import Launched, StepDraw
from conveyor.worker.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    kv_cache_dtype,
)
from conveyor.worker.kv_scales import calibrate_kv_scales, set_kv_scales
from conveyor.worker.layers.lora import LoRABatch
from conveyor.worker.layers.parallel import min_over_ranks, tp_rank, tp_size
from conveyor.worker.layers.pipeline import recv_activations, send_activations, stage
from conveyor.worker.layers.quantization import QuantReport, check_device, resolve_mode
from conveyor.worker.loader import load_model
from conveyor.worker.sampler import Sampler, SeqSamplingState
from conveyor.worker.spec import ModelProposer, NoGuesses, make_proposer
from conveyor.worker.step_inputs import StepInputs
from conveyor.worker.structured import StructuredOutputMasks

_PROFILE_PARAMS = SamplingParams(temperature=0)


@dataclass
class Slot:
    num_blocks: int                  # entries of its row of the block table in use
    num_computed: int
    state: SeqSamplingState          # holds the token ids (prompt + output so far)
    lora: LoRARequest | None = None  # its adapter


# NOTE: what the pool leaves of the memory free when it is sized, where that bounds it (another
# engine of the process holds the rest): the pool's per-layer tensors, rounded up by the
# allocator, came to more than an exact fit and the last one failed on an H200
FREE_MARGIN_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, files: ModelFiles,
                 max_model_len: int, device: torch.device | None = None):
        self.config = config
        self.model_config = model_config
        self.files = files
        self.device = device or torch.device(config.device)
        self.stage = stage()        # of the pipeline: one stage holding every layer without one
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.kv_dtype = kv_cache_dtype(config, self.dtype)    # the pool's: float8 or self.dtype
        torch.manual_seed(config.seed)
        self._memory_before = 0      # CUDA bytes held before this runner (another engine's)
        if self.device.type == "cuda":
            gc.collect()             # an earlier engine of this process that is unreachable
            torch.cuda.empty_cache()
            self._memory_before = torch.cuda.memory_allocated(self.device)
        quantization = resolve_mode(config.quantization, model_config.quantization)
        check_device(quantization, self.device)
        self.model = load_model(model_config, files, self.dtype, self.device,
                                quantization, config.keep_patterns, config.load_format,
                                config.seed)
        self.quant_report: QuantReport | None = self.model.quant_report
        self.lora = None             # adapter slots (worker/lora.py), before the pool is sized
        if config.enable_lora:
            from conveyor.worker.lora import LoRAManager

            self.lora = LoRAManager(self.model, model_config, config, self.dtype, self.device)
        # fp8 pool: per-layer (k_scale, v_scale), measured before sizing and graph capture
        self.kv_scales: list[tuple[float, float]] | None = None
        if config.kv_cache_fp8:       # a quantized checkpoint's own scales, else measured
            self.kv_scales = self.model.checkpoint_kv_scales or calibrate_kv_scales(
                self.model, model_config, config, max_model_len, self.dtype, self.device)
            set_kv_scales(self.model, self.kv_scales)
        self.sampler = Sampler(model_config.vocab_size, model_config.eos_token_ids, config.seed,
                               self.device)
        self.structured = None    # matchers and bitmasks of structured outputs (rank 0 only)
        if tp_rank() == 0 and self.stage.last:
            self.structured = StructuredOutputMasks(files, config.tokenizer,
                                                    model_config.vocab_size,
                                                    model_config.eos_token_ids,
                                                    config.max_num_seqs, self.device)
        spec = config.speculative
        self.drafter: ModelProposer | None = None   # draft_model: the draft, its pool and q
        proposer = make_proposer(spec) if spec is not None and spec.method == "ngram" else None
        if spec is not None and spec.method == "draft_model":
            from conveyor.worker.spec.draft_model import DraftModelProposer

            replicated = spec.draft_tensor_parallel_size == 1 and tp_size() > 1
            if replicated and tp_rank() != 0:
                proposer = NoGuesses()        # rank 0 holds the whole draft and guesses
            else:
                self.drafter = proposer = DraftModelProposer(
                    config, model_config, files, self.dtype, self.device, max_model_len,
                    replicated)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.graphs = None      # CUDA graphs of the forward pass, made once the pool exists
        max_blocks = -(-max_model_len // self.block_size)
        self.inputs = StepInputs(config.max_num_seqs, max_blocks, self.block_size, self.device)
        self._pending: Launched | None = None   # submitted, result not taken yet
        self.num_blocks = min_over_ranks(self._num_blocks(), self.device)
        self.kv_caches = allocate_kv_cache(model_config, config, self.num_blocks, self.kv_dtype,
                                           self.device)
        self.slots: dict[int, Slot] = {}
        graph_args = None
        # NOTE: a pipeline stage runs eagerly: a graph would need the received activations as
        # an input buffer and the send inside it (not built)
        if self.device.type == "cuda" and not config.enforce_eager and self.stage.count == 1:
            from conveyor.worker.cuda_graph import StepGraphs

            graph_args = (min(config.max_num_seqs, 512), config.max_num_seqs,
                          self._max_graph_tokens(), max_blocks)
            self.graphs = StepGraphs(self.model, self.kv_caches, *graph_args, self.device,
                                     self.lora)
        if self.drafter is not None:
            self.drafter.bind(self.num_blocks, self.slots, self.inputs, self.sampler, graph_args)
        # the draw holds the proposer: it guesses once a step's tokens are read
        self.draw = StepDraw(self.sampler, self.structured, proposer, self.drafter, self.slots,
                             self.block_size, self.device)

    def describe(self) -> dict[str, int | float | str]:
        """What the start-up summary says of this runner."""
        info = {"num_blocks": self.num_blocks, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "kv_dtype": str(self.kv_dtype).removeprefix("torch.")}
        if self.quant_report is not None:
            info["quantization"] = self.quant_report.summary()
        if self.drafter is not None:
            info["draft_model"] = self.drafter.describe()
        return info

    def _max_graph_tokens(self) -> int:
        """The largest mixed step run from a CUDA graph (0: none).

        NOTE: by default 2048: a graph pays while the step's ~400 eager launches (15-40 ms of
        host time) outlast its GPU work, and on an H200 that ends near 2-4k tokens for
        Qwen3-0.6B and 1-2k for Llama-3.1-8B (docs/BENCHMARKS.md, "CUDA graphs of mixed steps").
        """
        limit = self.config.max_cudagraph_capture_size
        return min(2048 if limit is None else limit, self.config.max_num_batched_tokens)

    # --- sizing -------------------------------------------------------------------------------

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        # NOTE: more blocks than every sequence at full length could use only feed the prefix
        # cache; the pool stops there so a small model neither zeroes gigabytes on the CPU nor
        # hands the scheduler tens of millions of blocks to list on a large GPU.
        enough = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.device.type == "cpu":
            budget = self.config.kv_cache_memory_bytes
            if self.drafter is not None:
                budget -= self.drafter.scratch_bytes()
            return min(enough, budget // self._block_bytes())
        return min(enough, self._profile_gpu_blocks())

    def _block_bytes(self) -> int:
        """What a block costs: its KV in the target's pool and, speculating with a draft
        model, in the draft's."""
        own = bytes_per_block(self.model_config, self.config, self.kv_dtype)
        return own + (self.drafter.kv_bytes_per_block() if self.drafter is not None else 0)

    def _profile_gpu_blocks(self) -> int:
        """Run the largest step once and give the KV pool what is left of the memory budget.

        The budget is `gpu_memory_utilization` of the device for this engine alone: memory
        another engine of the process already holds is not counted against it, and the pool
        leaves FREE_MARGIN_BYTES of what is free now.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        # NOTE: runs before the real pool exists: a pool just big enough for this one step
        self.kv_caches = allocate_kv_cache(self.model_config, self.config, blocks,
                                           self.kv_dtype, self.device)
        self.slots = {0: Slot(0, 0, SeqSamplingState.new(_PROFILE_PARAMS, [0] * num_tokens,
                                                         num_tokens, self.device))}
        self._add_blocks(0, list(range(blocks)))
        self._forward([(0, num_tokens, True, -1, [])], logits_rows=self.config.max_num_seqs)
        self.slots, self.kv_caches = {}, []
        peak = torch.cuda.max_memory_allocated(self.device) - self._memory_before
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.empty_cache()
        # what the peak step needs beyond what is allocated now must stay free as well
        free = torch.cuda.mem_get_info(self.device)[0] - (
            peak + self._memory_before - torch.cuda.memory_allocated(self.device))
        free_bytes = min(int(total * self.config.gpu_memory_utilization) - peak,
                         free - FREE_MARGIN_BYTES)
        if self.drafter is not None:
            free_bytes -= self.drafter.scratch_bytes()
        num = free_bytes // self._block_bytes()
        if num < 1:
            raise RuntimeError(f"no memory left for the KV cache: this engine's peak "
                               f"{peak / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free of "
                               f"{total / 2**30:.1f} GiB; raise gpu_memory_utilization or lower "
                               f"max_num_batched_tokens")
        return num

    # --- steps --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step to its end (the sequential path)."""
        if self._pending is not None:
            raise RuntimeError(f"execute() while step {self._pending.step} is in flight")
        self.submit(plan)
        return self.flush()

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> StepResult | None:
        """Queue `plan` on the device; return the result of the step submitted before it (None
        if there is none), taken only once `plan`'s forward pass is queued behind it.

        Order: the forward pass of `plan` (decodes fed by the previous step's draw on the
        device), then the previous step's tokens to the host (by then its sampling is done or
        nearly), then the sampling of `plan` (penalties and min_tokens count those tokens).
        Every rank makes the same collective calls in the same order: forward, then sampling.
        A step with constrained rows whose predecessor's forward pass is already done on the
        device (the host bounds the step) reads the previous tokens first instead, so that its
        bitmask fills while its own forward pass is being launched (`_reads_first`).
        """
        self._sample_deferred()
        steps = self._admit(plan)
        states = [self.slots[s[0]].state for s in steps if s[2]]
        propose = plan.propose and self.draw.proposer is not None
        defer = bool(steps) and self._defers(states, any(s[4] for s in steps),
                                             propose and self.drafter is not None)
        masks = result = None
        if defer and self._reads_first():
            result = self.flush()
            masks = self.structured.fill(states) if tp_rank() == 0 else None
        launched = self._forward(steps, step=plan.step) if steps else Launched(plan.step, [],
                                                                                None, [])
        launched.propose = propose
        if result is None:
            result = self.flush()
        if defer:
            launched.deferred = True
            if tp_rank() == 0:
                launched.masks = masks or self.structured.fill(launched.states)
        else:
            self.draw.sample(launched)
        self._pending = launched
        return result

    @torch.inference_mode()
    def flush(self) -> StepResult | None:
        """The result of the step in flight, waiting for it; None if there is none."""
        self._sample_deferred()
        pending, self._pending = self._pending, None
        return None if pending is None else self.draw.result(pending)

    @property
    def in_flight(self) -> bool:
        """Whether a submitted step's result is not taken yet."""
        return self._pending is not None

    def step_done(self) -> bool:
        """Whether flush() would not wait long: no step in flight, its bitmask filled if its
        sampling waits for one, and it is done on the device."""
        p = self._pending
        if p is None:
            return True
        if p.deferred:
            return p.masks is None or p.masks.ready()
        return p.done is None or p.done.query()

    def _defers(self, states: list[SeqSamplingState], drafted: bool, drafting: bool) -> bool:
        """Whether a step's sampling waits for the next submit (or flush): a step with
        constrained rows, whose bitmask is then filled on a thread while the engine plans.
        Decided from the requests' parameters, which every rank holds alike, so the ranks'
        collective calls stay in one order; not with guesses to verify, nor when a draft model
        guesses right after the step (`drafting`), nor with pipeline stages."""
        return (not drafted and not drafting and self.stage.first and self.stage.last
                and any(s.params.structured_outputs is not None for s in states))

    def _reads_first(self) -> bool:
        """Whether the step in flight may be read before the next forward pass is launched:
        its own forward pass is done on the device (or there is none), so waiting for its
        sampling costs little, and the next step's bitmask fills during the launch (about
        1 ms of host time for a small model at batch 64) instead of after it. While the
        device is still busy with it, launching first keeps the device fed instead."""
        p = self._pending
        return p is None or p.forward_done is None or p.forward_done.query()

    def _sample_deferred(self) -> None:
        """Sample the step in flight if its sampling was deferred (before the next forward
        pass, which reads its tokens on the device)."""
        p = self._pending
        if p is not None and p.deferred:
            self.draw.sample(p)

    def _admit(self, plan: StepPlan) -> list[tuple[int, int, bool, int, list[int]]]:
        """Take `plan`'s slot changes (freed, new, new blocks); its steps for `_forward`."""
        for slot in plan.freed:
            self.slots.pop(slot, None)
        for seq in plan.new:
            state = SeqSamplingState.new(seq.sampling, list(seq.token_ids), seq.prompt_len,
                                         self.device)
            if seq.sampling.structured_outputs is not None and self.structured is not None:
                self.structured.start(state, seq.sampling.structured_outputs)
            self.slots[seq.slot] = Slot(0, seq.num_computed, state, seq.lora)
            self._add_blocks(seq.slot, seq.block_ids)
        steps = []
        for s in plan.seqs:
            if s.new_block_ids:
                self._add_blocks(s.slot, s.new_block_ids)
            if s.token_ids and not self.stage.last:
                # pipeline parallel: the tokens the last stage drew since this one last ran it
                self.slots[s.slot].state.token_ids.extend(s.token_ids)
            steps.append((s.slot, s.num_tokens, s.sample, s.prompt_logprobs_from,
                          s.draft_token_ids))
        return steps

    def _stage_forward(self, tokens3: torch.Tensor, ctx: StepContext, profile: bool
                       ) -> torch.Tensor | None:
        """A pipeline stage's part of a step: the previous stage's activations in (zeros when
        profiling), this stage's layers, and its activations out to the next stage. Returns
        the final hidden states on the last stage, None on the others."""
        intermediate = None
        if not self.stage.first:
            num_tokens, hidden_size = tokens3.shape[1], self.model_config.hidden_size
            intermediate = (tuple(torch.zeros(num_tokens, hidden_size, dtype=self.dtype,
                                              device=self.device) for _ in range(2))
                            if profile else
                            recv_activations(num_tokens, hidden_size, self.dtype, self.device))
        out = self.model(tokens3[0], tokens3[1], ctx, intermediate)
        if self.stage.last:
            return out
        if not profile:
            send_activations(*out)
        return None

    def _lora_step(self, dev: dict[str, torch.Tensor], lora_slots: list[int] | None):
        """The adapters of an eager step, for the model's LoRA layers."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.state.step(LoRABatch(dev["tokens"][3], dev["lora_order"],
                                              dev["lora_starts"],
                                              sorted(set(lora_slots) - {-1})))

    def _add_blocks(self, slot_id: int, block_ids: list[int]) -> None:
        slot = self.slots[slot_id]
        self.inputs.add_blocks(slot_id, slot.num_blocks, block_ids)
        slot.num_blocks += len(block_ids)

    def _forward(self, steps: list[tuple[int, int, bool, int, list[int]]], step: int = 0,
                 logits_rows: int = 0) -> Launched:
        """steps: (slot, num_tokens, sample, prompt_logprobs_from, draft_token_ids) in batch
        order. Queues the forward pass and the logits; waits for nothing on the device."""
        prev = self._pending
        # NOTE: a step with guesses is read on the host before the next is launched
        prev_rows = ({id(s): i for i, s in enumerate(prev.states)}
                     if prev is not None and prev.drafts is None else {})
        input_ids: list[int] = []
        starts, query_lens, seq_lens = [], [], []
        sample_rows, sample_states, sample_slots, drafts = [], [], [], []
        lp_rows, prompt_rows = [], []            # prompt-logprob rows; (slot, targets, top-k)
        gather_rows, gather_from = [], []        # rows fed by prev's draw, and its rows there
        for slot_id, n, sample, lp_from, guesses in steps:
            slot = self.slots[slot_id]
            start, end = slot.num_computed, slot.num_computed + n
            tokens = slot.state.token_ids
            row0 = len(input_ids)
            known = end - len(guesses)           # the step's tokens before its guesses
            if guesses and (n != 1 + len(guesses) or not sample or known < len(tokens)):
                raise RuntimeError(f"slot {slot_id}: {len(guesses)} guesses planned over "
                                   f"tokens [{start}, {end}), but {len(tokens)} known")
            if known <= len(tokens):
                input_ids.extend(tokens[start:known])
            elif known == start + 1 == len(tokens) + 1 and id(slot.state) in prev_rows:
                # NOTE: the input is the token the previous step is sampling for this sequence;
                # it is not on the host yet and is copied on the device (StepInputs.build).
                gather_rows.append(row0)
                gather_from.append(prev_rows[id(slot.state)])
                input_ids.append(0)
            else:
                raise RuntimeError(f"slot {slot_id}: tokens [{start}, {end}) planned, but "
                                   f"{len(tokens)} known")
            input_ids.extend(guesses)            # verified: every row from the last token samples
            starts.append(start)
            query_lens.append(n)
            seq_lens.append(end)
            if sample:
                sample_rows.extend(range(row0 + n - 1 - len(guesses), row0 + n))
                sample_states.append(slot.state)
                sample_slots.append(slot_id)
                drafts.append(guesses)
            # prompt position p is predicted by the row of position p - 1
            first, last = max(lp_from, start + 1), min(end + 1, slot.state.prompt_len)
            if lp_from >= 0 and first < last:
                lp_rows.extend(range(row0 + first - 1 - start, row0 + last - 1 - start))
                prompt_rows.append((slot_id, tokens[first:last],
                                    slot.state.params.prompt_logprobs))
            slot.num_computed = end

        num_seqs, num_tokens = len(steps), len(input_ids)
        graph = (self.graphs.pick(num_seqs, num_tokens)
                 if self.graphs is not None and not logits_rows else None)
        rows = sample_rows + lp_rows
        lora_slots = (self.lora.slots_for([self.slots[s[0]].lora for s in steps])
                      if self.lora is not None else None)
        dev = self.inputs.build([s[0] for s in steps], input_ids, starts, query_lens, seq_lens,
                                rows, graph.tokens if graph else num_tokens,
                                graph.seqs if graph else num_seqs, gather_rows, gather_from,
                                prev.sampled if prev is not None else None, lora_slots,
                                self.lora.num_slots if self.lora is not None else 0)
        ctx = None
        if graph is not None:
            hidden = self.graphs.run(graph, num_seqs, dev, self.inputs.block_tables)
        else:
            tokens3 = dev["tokens"]               # [3, T]: ids, pos, slot (+ adapter slot)
            ctx = self.inputs.context(dev, self.kv_caches, query_lens, seq_lens)
            with self._lora_step(dev, lora_slots):
                if self.stage.count == 1:
                    hidden = self.model(tokens3[0], tokens3[1], ctx)
                else:
                    hidden = self._stage_forward(tokens3, ctx, bool(logits_rows))
        if hidden is None:                   # a pipeline stage before the last: nothing to draw
            return Launched(step, [], None, [])
        if self.drafter is not None and not logits_rows:
            self.drafter.alongside(dev, graph, num_seqs, ctx)
        if logits_rows:  # profiling: the largest logits a step can make, and their float32 copy
            self.model.compute_logits(hidden[-1:].expand(logits_rows, -1)).float()
            return Launched(step, [], None, [])
        # NOTE: the logits are taken now: the next step's graph replay overwrites `hidden`.
        logits = self.model.compute_logits(hidden[dev["rows"]]) if rows else None
        launched = Launched(step, sample_states, logits, prompt_rows,
                             drafts if any(drafts) else None, sample_slots)
        if self.device.type == "cuda":
            launched.forward_done = torch.cuda.Event()
            launched.forward_done.record()
        return launched
