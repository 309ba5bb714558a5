"""A request's own edits of its logits before any draw, in this order: penalties (repetition,
frequency, presence), logit_bias, allowed_token_ids, bad words, and min_tokens' ban of the end
tokens.

One function for a plain draw (worker/sampler.py) and for verifying guesses (spec/verify.py), so
a guess is judged by the distribution its request samples from.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.worker.sampling_ops import on_rows, pad_rows, to_device, uses_penalty

if TYPE_CHECKING:
    from conveyor.worker.sampler import SeqSamplingState


def edits_logits(states: list[SeqSamplingState]) -> bool:
    """Whether `edit_logits` changes any of these rows."""
    return any(uses_penalty(s.params) or s.params.logit_bias or s.params.allowed_token_ids
               or s.params.bad_words_token_ids or s.num_output_tokens < s.params.min_tokens
               for s in states)


def edit_logits(x: torch.Tensor, states: list[SeqSamplingState], vocab_size: int,
                eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """x [N, V] float32, row i for states[i], with each row's edits (in place, but for
    penalties on every row: use the result)."""
    params = [s.params for s in states]
    penalised = [i for i, p in enumerate(params) if uses_penalty(p)]
    if penalised:
        x = on_rows(x, penalised, lambda sub: _penalties(
            sub, [states[i] for i in penalised], vocab_size))
    rows, cols, bias = [], [], []
    for i, p in enumerate(params):
        for tok, value in (p.logit_bias or {}).items():
            if tok < vocab_size:
                rows.append(i)
                cols.append(tok)
                bias.append(value)
    if rows:
        x.index_put_((to_device(rows, x.device), to_device(cols, x.device)),
                     to_device(bias, x.device, torch.float32), accumulate=True)
    only = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if only:
        rows = [i for i in only for t in params[i].allowed_token_ids if t < vocab_size]
        cols = [t for i in only for t in params[i].allowed_token_ids if t < vocab_size]
        r, c = to_device(rows, x.device), to_device(cols, x.device)
        kept = x[r, c]
        x[to_device(only, x.device)] = float("-inf")
        x[r, c] = kept
    _ban_bad_words(x, states, vocab_size)
    _ban_early_ends(x, states, vocab_size, eos_token_ids)
    _end_dead_rows(x, states, eos_token_ids)
    return x


def _ban_bad_words(x: torch.Tensor, states: list[SeqSamplingState], vocab_size: int) -> None:
    """-inf at the last token of each bad word whose other tokens end the output so far (a
    one-token word: always)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if not s.params.bad_words_token_ids:
            continue
        output = s.token_ids[s.prompt_len:]
        for ids in s.params.bad_words_token_ids:
            n = len(ids) - 1
            if ids[-1] < vocab_size and len(output) >= n and (
                    not n or output[len(output) - n:] == ids[:-1]):
                rows.append(i)
                cols.append(ids[-1])
    if rows:
        x[to_device(rows, x.device), to_device(cols, x.device)] = float("-inf")


def _ban_early_ends(x: torch.Tensor, states: list[SeqSamplingState], vocab_size: int,
                    eos_token_ids: tuple[int, ...]) -> None:
    """-inf at EOS and the stop ids of rows still below min_tokens.

    NOTE: EOS is banned even with ignore_eos, as vLLM does (its min-tokens set always has EOS).
    """
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if s.num_output_tokens < s.params.min_tokens:
            banned = [t for t in {*eos_token_ids, *s.params.stop_token_ids} if t < vocab_size]
            rows += [i] * len(banned)
            cols += banned
    if rows:
        x[to_device(rows, x.device), to_device(cols, x.device)] = float("-inf")


def _end_dead_rows(x: torch.Tensor, states: list[SeqSamplingState],
                   eos_token_ids: tuple[int, ...]) -> None:
    """A row whose constraints leave no token draws EOS: the output ends there (and
    scheduler/stop.py ends it, min_tokens or not) where a row of -inf would draw a token nothing
    allows. Only bans can meet a mask or each other there: allowed_token_ids (beside a grammar,
    or of end tokens below min_tokens), and a grammar's row with min_tokens' end bans or bad
    words; only those rows are looked at, on the device (no wait for it)."""
    rows = [i for i, s in enumerate(states) if s.params.allowed_token_ids or (
        s.params.structured_outputs is not None
        and (s.num_output_tokens < s.params.min_tokens or s.params.bad_words_token_ids))]
    if not rows or not eos_token_ids:
        return
    r = to_device(rows, x.device)
    dead = torch.isneginf(x[r]).all(-1)
    eos = eos_token_ids[0]
    x[r, eos] = torch.where(dead, torch.zeros_like(dead, dtype=x.dtype), x[r, eos])


def _penalties(x: torch.Tensor, states: list[SeqSamplingState], vocab_size: int
               ) -> torch.Tensor:
    """x: [R, V] logits of rows with some penalty. Returns penalised logits [R, V]."""
    V = vocab_size
    outputs = pad_rows([s.token_array()[s.prompt_len:] for s in states], V, x.device)  # [R, Lo]
    counts = torch.zeros(x.shape[0], V + 1, device=x.device)  # [R, V + 1]; column V: padding
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=counts.dtype))
    counts = counts[:, :V]  # [R, V]
    in_output = counts > 0

    def per_row(name: str) -> torch.Tensor:  # [R, 1]
        return to_device([getattr(s.params, name) for s in states], x.device)[:, None]

    if any(s.params.repetition_penalty != 1 for s in states):
        prompts = pad_rows([s.token_array()[:s.prompt_len] for s in states], V, x.device)
        seen = torch.zeros(x.shape[0], V + 1, dtype=torch.bool, device=x.device)
        seen.scatter_(1, prompts, torch.ones_like(prompts, dtype=torch.bool))
        seen = seen[:, :V] | in_output  # [R, V]
        rep = per_row("repetition_penalty")
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return (x - per_row("frequency_penalty") * counts
            - per_row("presence_penalty") * in_output)
