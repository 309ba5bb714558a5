"""Draft-model proposals: a smaller model with the target's tokenizer guesses the next k tokens,
one forward pass a token, beside the target in every worker.

Its KV lives in its own paged pool with the target's block ids, so the scheduler's block tables
serve both. It runs alongside every forward pass of the target, on the same inputs (prompts and
their chunks, decodes, verified guesses), so its KV covers exactly the positions the target's
does, prefix-cache hits included; rejected guesses are rewound with the target's position and
written again by the next pass. Then, for each sequence that sampled, k decode steps: the last
token, then its own guesses, one at a time. Those write KV at positions the target has not
computed; past the sequence's blocks they go to scratch blocks of its slot (pool rows after the
shared ones), entered in the block table past the slot's last entry for these steps only.

Greedy requests guess the draft's argmax. Sampled ones draw from q, the draft's distribution under
the request's temperature, top-k, top-p and min-p; verification accepts a guess d with
probability min(1, p(d) / q(d)) (spec/verify.py), so q is kept per slot until the next step
verifies its guesses. The draft is sharded over the tensor-parallel ranks like the target; every
rank runs it and rank 0 draws (its tokens are broadcast). Or, `replicated`
(draft_tensor_parallel_size 1), rank 0 alone holds it whole and runs it inside
`single_rank()`, with no collectives: only rank 0's guesses and q are used, so the other ranks
need none. On a GPU its forward passes replay CUDA graphs of its own (the target's StepGraphs,
over the draft and its pool).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from conveyor.shared.config import EngineConfig
from conveyor.shared.model_config import ModelConfig
from conveyor.shared.model_files import ModelFiles
from conveyor.worker.kv_cache import allocate_kv_cache, bytes_per_block
from conveyor.worker.layers.parallel import broadcast_tensor, single_rank, tp_rank, tp_size
from conveyor.worker.layers.quantization import resolve_mode
from conveyor.worker.loader import load_model
from conveyor.worker.sampler import Sampler, SeqSamplingState
from conveyor.worker.sampling_ops import to_device
from conveyor.worker.spec.draft_files import draft_model_files
from conveyor.worker.spec.verify import _filtered
from conveyor.worker.step_inputs import StepInputs


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target: ModelConfig, target_files: ModelFiles,
                 dtype: torch.dtype, device: torch.device, max_model_len: int,
                 replicated: bool = False):
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        self.files, self.model_config = draft_model_files(spec, target, target_files,
                                                          config.revision)
        # every call that builds or runs the draft goes through _ranks()
        self._ranks = single_rank if replicated else nullcontext
        if not replicated:
            _check_shards(self.model_config, tp_size())
        self.config = config
        self.dtype, self.device = dtype, device
        self.vocab_size = target.vocab_size          # of the guesses and of q
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        # the k positions a proposal writes past the last computed token span at most this
        # many blocks the sequence may not hold yet
        self.scratch_per_slot = -(-self.k // self.block_size)
        # NOTE: quantized as the target is (--quantization, or its checkpoint's own)
        quantization = resolve_mode(config.quantization, self.model_config.quantization)
        with self._ranks():
            self.model = load_model(self.model_config, self.files, dtype, device, quantization,
                                    config.keep_patterns, config.load_format, config.seed,
                                    first_layers=spec.draft_num_layers is not None)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None
        self.num_blocks = 0
        self.slots = None            # the runner's slots (slot id -> Slot: num_blocks)
        self.inputs: StepInputs | None = None
        self.sampler: Sampler | None = None
        # per slot: its last guesses and, for sampled requests, q of each [k, V] (rank 0)
        self._proposed: dict[int, tuple[list[int], torch.Tensor | None]] = {}

    def describe(self) -> str:
        m = self.model_config
        return (f"{self.files.path} ({m.num_hidden_layers} layers, "
                f"{self.kv_bytes_per_block()} KV bytes a block), k={self.k}")

    # --- sizing -------------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """What a block of the shared pool costs in the draft's own pool."""
        with self._ranks():
            return bytes_per_block(self.model_config, self.config, self.dtype)

    def scratch_bytes(self) -> int:
        return self.config.max_num_seqs * self.scratch_per_slot * self.kv_bytes_per_block()

    def bind(self, num_blocks: int, slots: dict, inputs: StepInputs, sampler: Sampler,
             graph_args: tuple | None) -> None:
        """Allocate the pool (the shared num_blocks, then the scratch blocks) once the target's
        is sized; graph_args: StepGraphs' sizes (max decode batch, max sequences, max mixed
        tokens, max blocks a sequence) to capture the draft's graphs with, or None (eager)."""
        self.num_blocks, self.slots, self.inputs, self.sampler = num_blocks, slots, inputs, sampler
        total = num_blocks + self.config.max_num_seqs * self.scratch_per_slot
        with self._ranks():
            # NOTE: the draft's pool is in the model dtype even with an fp8 target pool
            self.kv_caches = allocate_kv_cache(self.model_config, self.config, total,
                                               self.dtype, self.device)
            if graph_args is not None:
                from conveyor.worker.cuda_graph import StepGraphs

                self.graphs = StepGraphs(self.model, self.kv_caches, *graph_args, self.device)

    # --- steps --------------------------------------------------------------------------------

    def alongside(self, dev: dict[str, torch.Tensor], graph, num_seqs: int, ctx) -> None:
        """Run the draft on the inputs of the target's step just queued (StepInputs.build's
        tensors; graph: the shape the target replayed, else ctx: its eager context)."""
        with self._ranks():
            if graph is not None:
                self.graphs.run(graph, num_seqs, {**dev, "tokens": dev["tokens"][:3]},
                                self.inputs.block_tables)
            else:
                tokens = dev["tokens"]
                self.model(tokens[0], tokens[1], replace(ctx, kv_caches=self.kv_caches))

    def propose(self, slots: list[int], states: list[SeqSamplingState]) -> list[list[int]]:
        """k guesses of each sequence (its tokens read, its position rewound past rejected
        guesses): k decode steps of the draft, each fed the token the one before drew."""
        if not slots:
            return []
        with self._ranks():
            return self._propose(slots, states)

    def _propose(self, slots: list[int], states: list[SeqSamplingState]) -> list[list[int]]:
        S, bs = len(slots), self.block_size
        last_pos = self.max_model_len - 1
        first = [len(s.token_ids) - 1 for s in states]       # position of the last token
        scratch = []                                          # (slot, first entry, count)
        for slot_id, p in zip(slots, first):
            slot = self.slots[slot_id]
            need = min(p + self.k - 1, last_pos) // bs + 1 - slot.num_blocks
            if need > 0:
                base = self.num_blocks + slot_id * self.scratch_per_slot
                self.inputs.add_blocks(slot_id, slot.num_blocks, list(range(base, base + need)))
                scratch.append((slot_id, slot.num_blocks, need))
        rank0 = tp_rank() == 0
        drawn, qs, random = [], [], []
        token = None
        for i in range(self.k):
            pos = [min(p + i, last_pos) for p in first]
            lens = [p + 1 for p in pos]
            graph = self.graphs.pick(S, S) if self.graphs is not None else None
            dev = self.inputs.build(
                slots, [s.token_ids[-1] for s in states] if i == 0 else [0] * S, pos, [1] * S,
                lens, list(range(S)), graph.tokens if graph else S, graph.seqs if graph else S,
                [] if i == 0 else list(range(S)), [] if i == 0 else list(range(S)), token)
            if graph is not None:
                hidden = self.graphs.run(graph, S, dev, self.inputs.block_tables)
            else:
                ctx = self.inputs.context(dev, self.kv_caches, [1] * S, lens)
                hidden = self.model(dev["tokens"][0], dev["tokens"][1], ctx)
            logits = self._logits(hidden[dev["rows"]])                  # [S, V]
            if rank0:
                token, q, random = self._draw(logits, states)
                qs.append(q)
            else:
                token = torch.empty(S, dtype=torch.long, device=self.device)
            token = broadcast_tensor(token)
            drawn.append(token)
        # NOTE: the scratch entries go (with the next step's inputs): the target's pool has no
        # such blocks, and its torch attention gathers a batch's table rows to the longest
        for slot_id, at, n in scratch:
            self.inputs.add_blocks(slot_id, at, [0] * n)
        guesses = torch.stack(drawn, 1).tolist()                        # [S, k]
        q_all = torch.stack(qs, 1) if rank0 and random else None        # [Sr, k, V]
        q_of = {i: r for r, i in enumerate(random)}
        # NOTE: a request the scheduler skips for a step keeps its guesses for a later one; the
        # entries of finished sequences go
        self._proposed = {s: v for s, v in self._proposed.items() if s in self.slots}
        self._proposed.update(
            (slot_id, (g, q_all[q_of[i]] if q_all is not None and i in q_of else None))
            for i, (slot_id, g) in enumerate(zip(slots, guesses)))
        return guesses

    def draft_probs(self, slots: list[int], drafts: list[list[int]],
                    states: list[SeqSamplingState]) -> torch.Tensor | None:
        """q of a verify step's rows ([R, V], R = sum of len(d) + 1; the rows without a guess
        and those of greedy requests are zeros, unread), or None when no request samples."""
        if all(s.params.greedy for s in states):
            return None
        out = torch.zeros(sum(len(d) + 1 for d in drafts), self.vocab_size, device=self.device)
        row = 0
        for slot_id, d, state in zip(slots, drafts, states):
            if d and not state.params.greedy:
                guesses, q = self._proposed.get(slot_id, ([], None))
                # NOTE: the scheduler verifies a prefix of the slot's last guesses, or none
                if q is None or guesses[:len(d)] != d:
                    raise RuntimeError(f"slot {slot_id}: guesses {d} to verify are not a prefix "
                                       f"of the draft's last ones {guesses}")
                out[row:row + len(d)] = q[:len(d)]
            row += len(d) + 1
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (cut, or padded with -inf)."""
        logits = self.model.compute_logits(hidden).float()
        V = self.vocab_size
        if logits.shape[1] >= V:
            return logits[:, :V]
        pad = logits.new_full((logits.shape[0], V - logits.shape[1]), float("-inf"))
        return torch.cat([logits, pad], 1)

    def _draw(self, logits: torch.Tensor, states: list[SeqSamplingState]
              ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Each row's guess (greedy: the argmax; else drawn from q), q of the sampled rows
        [Sr, V] (None if none) and their row numbers."""
        token = logits.argmax(-1)
        random = [i for i, s in enumerate(states) if not s.params.greedy]
        if not random:
            return token, None, []
        idx = to_device(random, logits.device)
        sub = [states[i] for i in random]
        z = _filtered(self.sampler, logits[idx], sub)                   # log-weights of q
        token[idx] = self.sampler._race(z, None, sub)
        return token, z.softmax(-1), random


def _check_shards(config: ModelConfig, tp: int) -> None:
    """ValueError unless the draft splits over tp ranks as the target's layers do."""
    if tp == 1:
        return
    kv = config.num_key_value_heads
    for what, n in (("attention heads", config.num_attention_heads),
                    ("MLP width", config.intermediate_size)):
        if n % tp:
            raise ValueError(f"speculative_config: the draft model's {n} {what} do not split "
                             f"over tensor_parallel_size {tp}: draft_tensor_parallel_size 1 "
                             f"runs it whole on one rank")
    if kv % tp and tp % kv:
        raise ValueError(f"speculative_config: the draft model's {kv} KV heads do not split "
                         f"over (nor replicate evenly on) tensor_parallel_size {tp}: "
                         f"draft_tensor_parallel_size 1 runs it whole on one rank")
