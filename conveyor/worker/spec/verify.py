"""Verification of guessed tokens: rejection sampling that keeps the target distribution exactly.

A sequence with j guesses d_1..d_j is run with j + 1 query tokens (its last token, then the
guesses); its logits row i is the target's distribution for the token after d_i (row 0: after
the last token). Each row is made into the distribution the sampler would draw from at that
position: penalties and min_tokens counting the guesses before it as output, then temperature,
top-k, top-p and min-p. Row by row (Leviathan et al. 2023; Chen et al. 2023):
- greedy: d_{i+1} is accepted while it is the row's argmax; the first row that disagrees gives
  its argmax, and a run of all j accepted gets row j's argmax (the bonus token);
- sampled: d_{i+1} is accepted with probability min(1, p(d) / q(d)), q the proposer's
  distribution (a point mass for n-gram guesses, so p(d)); at the first rejection a token is
  drawn from the residual max(0, p - q) normalised (p without d, for a point mass); a run of
  all j accepted draws the bonus token from row j.
So each output token has the target's distribution given the ones before it, whatever the
guesses. Returned logprobs are of the raw logits, as the sampler's.

A row's token is its guess exactly where the guess was accepted: a greedy row's argmax is its
guess when it agrees, and a rejected guess has no weight in the residual it is drawn from. So
only the tokens go to the host, and the accepted run of each sequence is read there
(`accepted_runs`): a greedy verification is one argmax on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.kernels.token_bitmask import apply_token_bitmask
from conveyor.worker.logit_edits import edits_logits
from conveyor.worker.sampler import LogprobTensors, Sampler, SeqSamplingState, gather_logprobs
from conveyor.worker.sampling_ops import keep_min_p, keep_top_p, to_device, uses_penalty


@dataclass
class Verified:
    """A batch's verification, still on the device."""
    token_ids: torch.Tensor              # [R] per row: its guess if accepted, else its draw
    logprob_rows: list[int]              # rows whose sequence asked for logprobs
    logprobs: LogprobTensors | None      # of logprob_rows, for token_ids there


def accepted_runs(token_ids: list[int], drafts: list[list[int]]) -> list[int]:
    """Per sequence the guesses accepted: the leading rows whose token is their guess (its
    rows 0..a then count, the last of them drawn)."""
    runs, row = [], 0
    for d in drafts:
        a = 0
        while a < len(d) and token_ids[row + a] == d[a]:
            a += 1
        runs.append(a)
        row += len(d) + 1
    return runs


def verify(sampler: Sampler, logits: torch.Tensor, states: list[SeqSamplingState],
           drafts: list[list[int]], draft_probs: torch.Tensor | None = None,
           allowed: tuple[torch.Tensor, torch.Tensor] | None = None) -> Verified:
    """logits: [R, >= V], the rows of sequence s back to back (len(drafts[s]) + 1 of them);
    draft_probs: [R, V] the proposer's distribution on the rows with a guess (None: point
    masses); allowed: structured outputs' (bitmask, rows), as `Sampler.sample_tensors` takes
    it, rows indexing `logits` (a constrained sequence's rows each masked after the guesses
    before it). Nothing here waits for the device."""
    V = sampler.vocab_size
    dev = logits.device
    raw = logits[:, :V]
    if allowed is not None:
        apply_token_bitmask(raw, *allowed)
    # per row: its guess (or -1), and its sampling state with the guesses before it counted as
    # output
    guess, row_states = [], []
    for state, d in zip(states, drafts):
        for i in range(len(d) + 1):
            guess.append(d[i] if i < len(d) else -1)
            row_states.append(state if i == 0 else _extended(state, d[:i]))
    params = [s.params for s in row_states]
    x = raw
    if edits_logits(row_states):
        x = sampler.edit(raw.float().clone(), row_states)              # [R, V]
    token_ids = x.argmax(-1)                                          # greedy draws
    random = [r for r, p in enumerate(params) if not p.greedy]
    if random:
        x = x.float()
        has_guess = to_device([g >= 0 for g in guess], dev, torch.bool)     # [R]
        g = to_device([max(g, 0) for g in guess], dev, torch.long)          # [R]
        idx = to_device(random, dev)
        sub = [row_states[r] for r in random]
        z = _filtered(sampler, x[idx], sub)                           # [Rr, V] log-weights
        p = z.softmax(-1)
        gr = g[idx][:, None]
        p_guess = p.gather(1, gr).squeeze(1)
        u = _uniform(sampler, sub, dev)
        guessed = has_guess[idx][:, None]
        if draft_probs is None:
            ok = u < p_guess
            # the residual: p without the guess (rows without one keep p)
            z = torch.where(guessed, z.scatter(1, gr, float("-inf")), z)
        else:
            q = draft_probs[idx]
            ok = u * q.gather(1, gr).squeeze(1) < p_guess
            z = torch.where(guessed, (p - q).clamp_(min=0).log(), z)
        token_ids[idx] = torch.where(ok & has_guess[idx], g[idx], sampler._race(z, None, sub))

    wants = [r for r, p in enumerate(params) if p.logprobs is not None]
    logprobs = None
    if wants:
        idx = to_device(wants, dev)
        logprobs = gather_logprobs(raw[idx].float().log_softmax(-1), token_ids[idx],
                                   [params[r].logprobs for r in wants])
    return Verified(token_ids, wants, logprobs)


def _extended(state: SeqSamplingState, guesses: list[int]) -> SeqSamplingState:
    """The state as it would be with `guesses` appended (for penalties, bad words and
    min_tokens)."""
    if not (uses_penalty(state.params) or state.params.min_tokens
            or state.params.bad_words_token_ids):
        return state                  # only its parameters and generator are read
    return SeqSamplingState(state.params, state.prompt_len, state.token_ids + guesses,
                            state.generator)


def _filtered(sampler: Sampler, x: torch.Tensor,
              states: list[SeqSamplingState]) -> torch.Tensor:
    """x: [R, V] logits of sampled rows; returns them over temperature with what top-k, top-p
    and min-p leave out at -inf: the log-weights of the distribution the sampler draws from."""
    params = [s.params for s in states]
    z = x / to_device([p.temperature for p in params], x.device, torch.float32)[:, None]
    top_k = [i for i, p in enumerate(params) if sampler._top_k(p)]
    if top_k:
        idx = to_device(top_k, x.device)
        sub = z[idx]
        k = to_device([params[i].top_k for i in top_k], x.device)[:, None]
        kth = sub.topk(int(k.max()), dim=-1).values.gather(1, k - 1)
        z[idx] = sub.masked_fill_(sub < kth, float("-inf"))
    top_p = [i for i, p in enumerate(params) if p.top_p < 1]
    if top_p:
        idx = to_device(top_p, x.device)
        z[idx] = keep_top_p(z[idx], [params[i].top_p for i in top_p])
    min_p = [i for i, p in enumerate(params) if p.min_p > 0]
    if min_p:
        idx = to_device(min_p, x.device)
        z[idx] = keep_min_p(z[idx], [params[i].min_p for i in min_p])
    return z


def _uniform(sampler: Sampler, states: list[SeqSamplingState],
             device: torch.device) -> torch.Tensor:
    """One U[0, 1) a row: from the request's own generator when seeded, else the sampler's."""
    u = torch.empty(len(states), device=device)
    shared = [i for i, s in enumerate(states) if s.generator is None]
    if shared:
        u[to_device(shared, device)] = torch.rand(len(shared), device=device,
                                                  generator=sampler.generator)
    for i, s in enumerate(states):
        if s.generator is not None:
            u[i] = torch.rand(1, device=device, generator=s.generator)[0]
    return u
