"""The request core of a frontend process, shared by its ZMQ and HTTP endpoints.

`submit` tokenizes a GenerateRequest, fans it out to the scheduler (one AddRequest per sample) and
remembers how to reach its caller: a `deliver` callback that gets the request's GenerateOutputs
(one per step when streaming, else one at the end). `on_outputs` folds the scheduler's
TokenOutputs back in. Every accepted request ends exactly once: finished, cancelled by its caller
(no reply), or failed with an error output (timeout, drain, engine failure). The core also holds
the server's state (starting, ready, draining, dead) and records each finished request's metrics.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from conveyor.frontend.tokenizer import apply_chat_template, check_token_ids
from conveyor.frontend.tracker import RequestTracker, sub_id
from conveyor.outputs import PositionLogprobs, RequestOutput
from conveyor.shared.messages import (
    Abort,
    Completion,
    GenerateOutput,
    GenerateRequest,
    Logprob,
    Stats,
    StatsRequest,
    TokenOutputs,
)
from conveyor.shared.sampling_params import INT64_MAX, INT64_MIN

STARTING, READY, DRAINING, DEAD = "starting", "ready", "draining", "dead"


class RequestError(ValueError):
    """A request the server will not take; `code` is the HTTP status that says why."""

    def __init__(self, message: str, code: int = 400):
        super().__init__(message)
        self.code = code


@dataclass
class _Open:
    client_id: str
    stream: bool
    deliver: Callable[[GenerateOutput], None]
    sent_tokens: list[int]                   # per sample: token ids delivered, -1 once ended
    sent_prompt: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass
class FrontendCore:
    tokenizer: object | None
    vocab_size: int
    max_model_len: int
    id_prefix: str                           # keeps request ids unique across frontends
    send: Callable[[object], None]           # a message to the scheduler
    max_open: int | None = None              # open requests beyond this are refused (429)
    timeout_s: float | None = None           # a request open longer than this fails (408)
    metrics: object | None = None            # ServerMetrics, or None
    max_n: int | None = None                 # a request's n beyond this is refused (400)
    state: str = STARTING
    open: dict[str, _Open] = field(default_factory=dict)
    _stats_waiters: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.tracker = RequestTracker(self.tokenizer)
        self._ids = itertools.count()

    # --- requests -----------------------------------------------------------------------------

    def submit(self, msg: GenerateRequest, deliver: Callable[[GenerateOutput], None],
               fit_context: bool = False) -> str:
        """Queue a request; returns its id. RequestError (with an HTTP status) if refused.

        fit_context: refuse a prompt plus max_tokens beyond the context length instead of
        ending it there, and read max_tokens=None as "the rest of the context" (OpenAI's rule).
        """
        if self.state != READY:
            raise RequestError(f"the server is {self.state}", 503)
        if self.max_open is not None and len(self.open) >= self.max_open:
            raise RequestError(f"the server is at its cap of {self.max_open} open requests", 429)
        try:
            if self.max_n is not None and msg.sampling.n > self.max_n:
                raise ValueError(f"n must be at most {self.max_n}, got {msg.sampling.n}")
            if not INT64_MIN <= msg.priority <= INT64_MAX:
                raise ValueError(f"priority must fit in 64 bits, got {msg.priority}")
            text, token_ids = self.tokenize(msg)
            params = self._fit(msg.sampling, len(token_ids)) if fit_context else msg.sampling
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer")
        except ValueError as e:
            raise RequestError(str(e)) from None
        rid = f"{self.id_prefix}{next(self._ids)}"
        adds = self.tracker.add(rid, text, token_ids, params, msg.priority,
                                cache_salt=msg.cache_salt, ttft_slo=msg.ttft_slo,
                                tpot_slo=msg.tpot_slo)
        o = _Open(msg.id, msg.stream, deliver, [0] * len(adds))
        if self.timeout_s is not None:
            o.timer = asyncio.get_running_loop().call_later(
                self.timeout_s, self._expire, rid)
        self.open[rid] = o
        for add in adds:
            self.send(add)
        return rid

    def tokenize(self, msg: GenerateRequest) -> tuple[str | None, list[int]]:
        given = [x is not None for x in (msg.prompt, msg.prompt_token_ids, msg.messages)]
        if sum(given) != 1:
            raise ValueError("set exactly one of prompt, prompt_token_ids and messages")
        if msg.prompt_token_ids is not None:
            check_token_ids(msg.prompt_token_ids, self.vocab_size)
            return None, list(msg.prompt_token_ids)
        if self.tokenizer is None:
            raise ValueError("this server has no tokenizer; send prompt_token_ids")
        if msg.messages is not None:
            return None, apply_chat_template(self.tokenizer, msg.messages)
        return msg.prompt, self.tokenizer.encode(msg.prompt)

    def _fit(self, params, prompt_len: int):
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"the prompt has {prompt_len} tokens, but the model's context "
                             f"length is {self.max_model_len} (prompt plus at least one "
                             f"generated token)")
        if params.max_tokens is None:
            return msgspec.structs.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise ValueError(f"the prompt has {prompt_len} tokens and max_tokens is "
                             f"{params.max_tokens}, but the model's context length is "
                             f"{self.max_model_len}; lower max_tokens to at most {room}")
        return params

    def cancel(self, rid: str) -> None:
        """The caller went away: abort the request in the engine; no reply follows."""
        if rid in self.open:
            self._end(rid, "abort", None, None, reply=False)

    def _expire(self, rid: str) -> None:
        if rid in self.open:
            self._end(rid, "error", f"the request took longer than {self.timeout_s:g} s", 408)

    def _end(self, rid: str, reason: str, error: str | None, code: int | None,
             reply: bool = True) -> None:
        """End an open request early: abort its running samples and (if reply) tell its caller."""
        req = self.tracker.requests[rid]
        running = [i for i, s in enumerate(req.seqs) if not s.out.finished]
        if running and self.state != DEAD:
            self.send(Abort(ids=[sub_id(rid, i) for i in running], reason="abort"))
        outputs = []
        for i in running:
            c = req.seqs[i].out
            c.finish_reason, c.error, c.error_code = reason, error, code
            outputs.append(Completion(i, finish_reason=reason, error=error, error_code=code))
        o = self.open[rid]
        if reply:
            o.deliver(GenerateOutput(o.client_id, outputs, True))
        self._close(rid)

    # --- scheduler ----------------------------------------------------------------------------

    def on_outputs(self, msg: TokenOutputs) -> None:
        updated, stopped = self.tracker.process(msg.outputs)
        if stopped:
            self.send(Abort(ids=stopped, reason="stop"))
        for rid in updated:
            if rid in self.open:
                self._reply(rid)

    def request_stats(self, waiter: Callable[[Stats | None], None]) -> None:
        """waiter gets the scheduler's next Stats, or None if the engine is gone."""
        if self.state == DEAD:
            waiter(None)
            return
        self._stats_waiters.append(waiter)
        self.send(StatsRequest())

    def on_stats(self, stats: Stats) -> None:
        if self._stats_waiters:
            self._stats_waiters.popleft()(stats)

    def _reply(self, rid: str) -> None:
        req, o = self.tracker.requests[rid], self.open[rid]
        finished = req.output.finished
        if not o.stream and not finished:
            return
        outputs = []
        for i, seq in enumerate(req.seqs):
            c = seq.out
            if o.sent_tokens[i] < 0:         # its end was delivered already
                continue
            text = self.tracker.stream_delta(rid, i) if o.stream else c.text
            start = o.sent_tokens[i] if o.stream else 0
            if start == len(c.token_ids) and not text and not c.finished:
                continue
            outputs.append(Completion(
                i, text, c.token_ids[start:],
                None if c.logprobs is None else [_wire_logprobs(p) for p in c.logprobs[start:]],
                c.finish_reason, c.stop_reason, c.error, c.error_code))
            o.sent_tokens[i] = -1 if c.finished else len(c.token_ids)
        if not outputs and not finished:
            return
        out = GenerateOutput(o.client_id, outputs, finished)
        if not o.sent_prompt:
            out.prompt_token_ids, o.sent_prompt = req.output.prompt_token_ids, True
        o.deliver(out)
        if finished:
            self._close(rid)

    def _close(self, rid: str) -> None:
        o = self.open.pop(rid)
        if o.timer is not None:
            o.timer.cancel()
        output = self.tracker.pop(rid)
        if self.metrics is not None:
            _finalize(output)
            self.metrics.request_finished(output)

    # --- server state -------------------------------------------------------------------------

    def fail_all(self, reason: str, code: int = 503) -> None:
        """End every open request with an error (engine failure, or a drain that ran out)."""
        for rid in list(self.open):
            self._end(rid, "error", reason, code)
        while self._stats_waiters:
            self._stats_waiters.popleft()(None)


def _finalize(output: RequestOutput) -> None:
    """Fill the metrics of a request that ended early (cancelled or failed)."""
    m = output.metrics
    if m.finished_time is None:
        m.finished_time = time.time()
        m.num_output_tokens = sum(len(c.token_ids) for c in output.outputs)


def _wire_logprobs(position: PositionLogprobs) -> list[Logprob]:
    return [Logprob(tok, lp.logprob, lp.rank or 0, lp.decoded_token)
            for tok, lp in position.items()]
