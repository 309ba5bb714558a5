"""Turns one row of logits per running sequence into its next token, plus logprobs when asked.

Order per row: the request's own edits (worker/logit_edits.py: penalties, logit_bias and
allowed_token_ids, min_tokens' ban of the end tokens), then greedy argmax, or temperature,
top-k, top-p, min-p and an exponential-race draw. Returned logprobs come from the raw logits (vLLM's
default). Each filter runs batched over only the rows that use it. `sample_tensors` never syncs the
device (its results stay there until the caller reads them); `sample` is it plus the read.

On CUDA with Triton, greedy and temperature-only rows are drawn by one fused kernel
(conveyor/kernels/sample.py) from the logits in the model's dtype, and rows with top-p or min-p
but no top-k by a rejection kernel that needs no sort (conveyor/kernels/sample_nucleus.py; it
keeps a tie at the top-p boundary whole, where the sort cuts it in the sort's order); rows with
top-k keep the torch path (one topk, then the filters on the [R, K] values). The kernels' noise
is Philox keyed per row (`_row_keys`), so those draws differ from the CPU's torch.Generator ones
(same distribution); CPU runs are unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.kernels import triton_available
from conveyor.kernels.token_bitmask import apply_token_bitmask
from conveyor.shared.messages.worker import TokenLogprobs
from conveyor.shared.sampling_params import SamplingParams
from conveyor.worker.logit_edits import edit_logits, edits_logits
from conveyor.worker.sampling_ops import (
    float_column,
    keep_min_p,
    keep_top_p,
    on_rows,
    to_device,
)


@dataclass
class SeqSamplingState:
    """What the sampler needs of one running sequence; the worker keeps it in its slot."""
    params: SamplingParams
    prompt_len: int
    token_ids: list[int]                     # prompt + output so far; the worker appends each token
    generator: torch.Generator | None        # seeded from params.seed; None: the shared generator
    grammar: object | None = None            # SeqGrammar of its structured outputs (rank 0)
    # token_ids as int64, for the penalties: converted as tokens arrive, not every step
    _array: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64), repr=False)
    _converted: int = 0

    @classmethod
    def new(cls, params: SamplingParams, token_ids: list[int], prompt_len: int,
            device: torch.device | str) -> SeqSamplingState:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(params, prompt_len, token_ids, generator)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def token_array(self) -> np.ndarray:
        """token_ids as an int64 array (a view, valid until the next call). Only the tokens
        appended since the last call are converted (token_ids only grows)."""
        n = len(self.token_ids)
        if n > len(self._array):
            grown = np.empty(max(n, 2 * len(self._array), 64), dtype=np.int64)
            grown[:self._converted] = self._array[:self._converted]
            self._array = grown
        if n > self._converted:
            self._array[self._converted:n] = self.token_ids[self._converted:]
            self._converted = n
        return self._array[:n]


@dataclass
class SampleOutput:
    token_ids: list[int]                     # one per row
    logprobs: list[TokenLogprobs | None]     # per row; None where params.logprobs is None


@dataclass
class LogprobTensors:
    """Logprobs at M positions: the chosen token first, then the top-k (rank order)."""
    ids: torch.Tensor                        # [M, K + 1] int64
    values: torch.Tensor                     # [M, K + 1] float32
    ranks: torch.Tensor                      # [M] int64: rank of the chosen token (1 = best)
    ks: list[int]                            # per position: top-k entries to keep (<= K)

    def to_host(self) -> LogprobTensors:
        """Start copying to the host (on CUDA asynchronously, into pinned memory: read the copy
        only once the stream got past it)."""
        return LogprobTensors(*(t.to("cpu", non_blocking=True)
                                for t in (self.ids, self.values, self.ranks)), self.ks)

    def tolist(self) -> list[TokenLogprobs]:
        ids, values, ranks = self.ids.tolist(), self.values.tolist(), self.ranks.tolist()
        return [TokenLogprobs(ids[r][: k + 1], values[r][: k + 1], ranks[r])
                for r, k in enumerate(self.ks)]


@dataclass
class SampledTensors:
    """A batch's draw, still on the device."""
    token_ids: torch.Tensor                  # [N] int64
    logprob_rows: list[int]                  # the rows that asked for logprobs
    logprobs: LogprobTensors | None          # of logprob_rows, in order

    def to_host(self) -> SampledTensors:
        """Start copying to the host (see LogprobTensors.to_host)."""
        return SampledTensors(self.token_ids.to("cpu", non_blocking=True), self.logprob_rows,
                              self.logprobs.to_host() if self.logprobs is not None else None)

    def output(self) -> SampleOutput:
        logprobs: list[TokenLogprobs | None] = [None] * self.token_ids.shape[0]
        if self.logprobs is not None:
            for i, lp in zip(self.logprob_rows, self.logprobs.tolist()):
                logprobs[i] = lp
        return SampleOutput(self.token_ids.tolist(), logprobs)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], seed: int,
                 device: torch.device | str):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.seed = seed
        self.num_fused_draws = 0             # calls of the fused kernel: its noise streams

    def sample(self, logits: torch.Tensor, states: list[SeqSamplingState]) -> SampleOutput:
        """logits: [N, >= vocab_size], row i for states[i]; columns past vocab_size are ignored."""
        return self.sample_tensors(logits, states).output()

    def sample_tensors(self, logits: torch.Tensor, states: list[SeqSamplingState],
                       allowed: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> SampledTensors:
        """`sample` without reading the result: nothing here waits for the device.

        allowed: (bitmask [R, ceil(V / 32)] int32, rows [R]) of structured outputs: those rows'
        banned tokens get -inf in `logits` (in place) before anything else, logprobs included.
        """
        logits = logits[:, : self.vocab_size]  # [N, V]
        if allowed is not None:
            apply_token_bitmask(logits, *allowed)
        fused = _fused(logits)
        if not fused:
            logits = logits.float()
        params = [s.params for s in states]
        wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        edited = edits_logits(states)
        if (not fused and all(p.greedy for p in params)
                and not (edited or wants_logprobs)):
            return SampledTensors(logits.argmax(-1), [], None)

        # [N, V]; float32 once edited
        x = self.edit(logits.to(torch.float32, copy=True), states) if edited else logits

        random = [i for i, p in enumerate(params) if not p.greedy]
        if fused:
            token_ids = self._sample_fused(x, states)
        elif not random:
            token_ids = x.argmax(-1)  # [N]
        elif len(random) == len(states):
            token_ids = self._sample_random(x, states)
        else:
            token_ids = x.argmax(-1)  # greedy rows keep these
            idx = to_device(random, x.device)
            token_ids[idx] = self._sample_random(x[idx], [states[i] for i in random])

        logprobs = None
        if wants_logprobs:
            idx = to_device(wants_logprobs, x.device)
            raw = logits if len(wants_logprobs) == len(states) else logits[idx]
            logprobs = gather_logprobs(raw.float().log_softmax(-1), token_ids[idx],
                                       [params[i].logprobs for i in wants_logprobs])
        return SampledTensors(token_ids, wants_logprobs, logprobs)

    def edit(self, x: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
        """x [N, V] float32 with each row's own edits (worker/logit_edits.py)."""
        return edit_logits(x, states, self.vocab_size, self.eos_token_ids)

    def _sample_fused(self, x: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
        """x: [N, V] logits (any float dtype, rows may be strided). Greedy and temperature-only
        rows in one kernel, rows with top-p or min-p (no top-k) in the rejection kernel, rows
        with top-k on the torch path."""
        from conveyor.kernels.sample import sample
        from conveyor.kernels.sample_nucleus import sample_nucleus

        params = [s.params for s in states]
        if all(p.greedy for p in params):
            return sample(x)
        filtered = [i for i, p in enumerate(params) if not p.greedy and self._filters(p)]
        top_k = [i for i in filtered if self._top_k(params[i])]
        nucleus = [i for i in filtered if not self._top_k(params[i])]
        temperature = [p.temperature for p in params]
        for i in filtered:
            temperature[i] = -1.0   # the kernel skips the row (token -1); another path fills it
        keys = to_device(self._row_keys(states), x.device)
        token_ids = sample(x, to_device(temperature, x.device, torch.float32), keys)
        self.num_fused_draws += 1
        if nucleus:
            idx = to_device(nucleus, x.device)
            per_row = np.array([[params[i].temperature, params[i].top_p, params[i].min_p]
                                for i in nucleus], dtype=np.float32).T.copy()
            t, top_p, min_p = to_device(per_row, x.device)
            token_ids[idx] = sample_nucleus(x, idx, t, top_p, min_p, keys[idx])
        if top_k:
            idx = to_device(top_k, x.device)
            token_ids[idx] = self._sample_random(x[idx].float(), [states[i] for i in top_k])
        return token_ids

    def _filters(self, p: SamplingParams) -> bool:
        """Whether p needs top-k, top-p or min-p (the fused kernel does none of them)."""
        return self._top_k(p) or p.top_p < 1 or p.min_p > 0

    def _top_k(self, p: SamplingParams) -> bool:
        """Whether p's top-k leaves out part of the vocabulary."""
        return 0 < p.top_k < self.vocab_size

    def _row_keys(self, states: list[SeqSamplingState]) -> np.ndarray:
        """The fused kernel's Philox key per row, [N] int64 (64 bits of a hash).

        Unseeded rows: a hash of (sampler seed, number of fused calls so far, row): fresh noise
        every call, reproducible for a given seed and sequence of batches. Seeded rows (seed s):
        a hash of (s, output tokens so far), so a seeded request's draws depend on neither the
        batch nor the engine's seed (its torch.Generator is not used).
        """
        seed = _mix64(np.array([self.seed & _MASK64], dtype=np.uint64))
        call = _mix64(seed + np.uint64(self.num_fused_draws))
        keys = _mix64(call + np.arange(len(states), dtype=np.uint64))
        seeded = [i for i, s in enumerate(states) if s.params.seed is not None]
        if seeded:
            seeds = np.array([states[i].params.seed & _MASK64 for i in seeded], dtype=np.uint64)
            done = np.array([states[i].num_output_tokens for i in seeded], dtype=np.uint64)
            keys[seeded] = _mix64(_mix64(seeds ^ _SEEDED) + done)
        return keys.view(np.int64)

    def prompt_logprob_tensors(self, logits: torch.Tensor, target_ids: list[int],
                               k: int) -> LogprobTensors:
        """logits: [P, >= vocab_size], row j predicting target_ids[j] (not empty); top-k from the
        raw logits. Nothing here waits for the device (LogprobTensors.to_host)."""
        logprobs = logits[:, : self.vocab_size].float().log_softmax(-1)  # [P, V]
        targets = to_device(target_ids, logits.device, torch.long)  # [P]
        return gather_logprobs(logprobs, targets, [k] * len(target_ids))

    def _sample_random(self, x: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
        """x: [R, V] logits of non-greedy rows (not edited). Returns the drawn token ids [R].

        Rows with top-k keep only their candidates: one topk, then top-p and min-p on the sorted
        [R, K] values. The other rows stay full width; pure-temperature rows skip every filter.
        """
        params = [s.params for s in states]
        top_k = [i for i, p in enumerate(params) if self._top_k(p)]
        if not top_k:
            return self._sample_full(x, states)
        if len(top_k) == len(states):
            return self._sample_top_k(x, states)
        token_ids = torch.empty(len(states), dtype=torch.long, device=x.device)
        rest = [i for i in range(len(states)) if i not in set(top_k)]
        for rows, fn in ((top_k, self._sample_top_k), (rest, self._sample_full)):
            idx = to_device(rows, x.device)
            token_ids[idx] = fn(x[idx], [states[i] for i in rows])
        return token_ids

    def _sample_full(self, x: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
        """x: [R, V]; temperature, then top-p and min-p over the whole vocabulary."""
        params = [s.params for s in states]
        temperature = float_column([p.temperature for p in params], x.device)  # [R, 1]
        top_p = [i for i, p in enumerate(params) if p.top_p < 1]
        min_p = [i for i, p in enumerate(params) if p.min_p > 0]
        if top_p or min_p:
            x = x / temperature  # [R, V], a fresh tensor the filters may edit
            if top_p:
                x = on_rows(x, top_p, lambda sub: keep_top_p(sub, [params[i].top_p for i in top_p]))
            if min_p:
                x = on_rows(x, min_p, lambda sub: keep_min_p(sub, [params[i].min_p for i in min_p]))
            temperature = None
        return self._race(x, temperature, states)

    def _sample_top_k(self, x: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
        """x: [R, V], every row with 0 < top_k < V; draws among each row's top-k only."""
        params = [s.params for s in states]
        ks = [p.top_k for p in params]
        values, ids = x.topk(max(ks), dim=-1)  # [R, K], sorted descending
        values = values / float_column([p.temperature for p in params], x.device)
        k = to_device(ks, x.device)[:, None]  # [R, 1]
        values.masked_fill_(values < values.gather(1, k - 1), float("-inf"))
        top_p = [i for i, p in enumerate(params) if p.top_p < 1]
        if top_p:
            values = on_rows(values, top_p, lambda sub: keep_top_p(
                sub, [params[i].top_p for i in top_p], is_sorted=True))
        min_p = [i for i, p in enumerate(params) if p.min_p > 0]
        if min_p:
            values = on_rows(values, min_p,
                             lambda sub: keep_min_p(sub, [params[i].min_p for i in min_p]))
        chosen = self._race(values, None, states, widths=ks)  # [R]
        return ids.gather(1, chosen[:, None]).squeeze(1)

    def _race(self, x: torch.Tensor, temperature: torch.Tensor | None,
              states: list[SeqSamplingState], widths: list[int] | None = None) -> torch.Tensor:
        """Exponential race over x [R, W] (logits, divided by temperature [R, 1] when given).

        argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability p_i; in logits that is
        argmax(x_i / T - log E_i) = argmax(x_i - T log E_i): no softmax, no division by T.
        NOTE: a seeded row draws from its own generator only (widths[r] values when given), so its
        tokens do not depend on the rest of the batch; the other rows share one batched draw.
        """
        noise = torch.empty_like(x, dtype=torch.float32)  # [R, W]
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if len(shared) == len(states):
            noise.exponential_(generator=self.generator)
        else:
            if widths is not None:
                noise.fill_(1.0)  # columns past a seeded row's width are -inf in x anyway
            if shared:
                noise[to_device(shared, x.device)] = torch.empty(
                    len(shared), x.shape[1], device=x.device).exponential_(
                        generator=self.generator)
            for i, s in enumerate(states):
                if s.generator is not None:
                    w = x.shape[1] if widths is None else widths[i]
                    noise[i, :w].exponential_(generator=s.generator)
        noise.log_()
        if temperature is None:
            return (x - noise).argmax(-1)
        return torch.addcmul(x, temperature, noise, value=-1).argmax(-1)


def _fused(logits: torch.Tensor) -> bool:
    """Whether the fused sampling kernel takes these logits (CUDA with Triton)."""
    return logits.is_cuda and triton_available()


_MASK64 = (1 << 64) - 1
_SEEDED = np.uint64(0x5EEDED5EEDED5EED)  # keeps seeded rows' keys apart from the shared ones


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 arrays that scrambles every bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                    ks: list[int]) -> LogprobTensors:
    """logprobs: [M, V], chosen: [M]. Per row: the chosen token, the top ks[r], its rank."""
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [M, 1]
    rank = (logprobs >= chosen_lp).sum(-1)  # [M]; ties count against the chosen token, as vLLM
    top_lp, top_ids = logprobs.topk(max(ks), dim=-1)  # [M, K]
    return LogprobTensors(torch.cat([chosen[:, None], top_ids], 1),
                          torch.cat([chosen_lp, top_lp], 1), rank, ks)
