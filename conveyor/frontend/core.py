"""The one request path: from a user's prompt and options to engine requests, and back.

Every door uses it: `LLM.generate` (in process), the HTTP server and the ZMQ server (in a frontend
process), and so the CLI. `submit` checks a GenerateRequest, tokenizes it (or applies the chat
template), fans it out to the engine (one AddRequest per sample, ids `<rid>/<i>`) and remembers
whom to `deliver` its RequestOutputs to: a delta per step when streaming, else the whole output at
the end. `on_outputs` folds the engine's TokenOutputs in: tokens, logprobs, detokenized text, stop
strings (a sequence a stop string ends is aborted in the engine). Every accepted request ends
exactly once: finished, cancelled by its caller (no reply), or failed with an error output
(timeout, drain, engine failure). The core also holds the server's state and records metrics.

What one request can cost is bounded before it is paid: frontend/prepare.py checks and tokenizes
it (a prompt too long for the context is refused before tokenizing), and `submit_async`
tokenizes a long prompt in a thread (the tokenizer releases the GIL), so the event loop keeps
serving everyone else. Any exception of the template, the tokenizer or the detokenizer fails
that request alone.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec

from conveyor.frontend.detokenizer import IncrementalDetokenizer, backend_of
from conveyor.frontend.prepare import RequestPreparer, tokenizes_inline
from conveyor.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.shared.lora import LoRARegistry, LoRARequest
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.messages.engine import (
    Abort,
    AddRequest,
    Stats,
    StatsRequest,
    TokenOutput,
)
from conveyor.shared.messages.worker import TokenLogprobs
from conveyor.shared.sampling_params import INT64_MIN, SamplingParams

STARTING, READY, DRAINING, DEAD = "starting", "ready", "draining", "dead"
log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the server will not take; `code` is the HTTP status that says why."""

    def __init__(self, message: str, code: int = 400):
        super().__init__(message)
        self.code = code


@dataclass(slots=True, eq=False)
class _Sample:
    out: CompletionOutput                    # the whole completion so far
    detok: IncrementalDetokenizer
    sent: int = 0                            # tokens delivered (streams); -1 once it ended
    last_token_time: float = 0.0             # when its latest tokens came (inter-token latency)


@dataclass(slots=True, eq=False)
class _Request:
    output: RequestOutput                    # the whole output so far
    samples: list[_Sample]
    deliver: Callable[[RequestOutput], None]
    stream: bool
    sent_prompt: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass
class FrontendCore:
    tokenizer: object | None
    vocab_size: int
    max_model_len: int
    id_prefix: str                           # keeps request ids unique across frontends
    send: Callable[[object], None]           # a message to the engine
    max_open: int | None = None              # open requests beyond this are refused (429)
    timeout_s: float | None = None           # a request open longer than this fails (408)
    metrics: object | None = None            # ServerMetrics, or None
    max_n: int | None = None                 # a request's n beyond this is refused (400)
    loras: LoRARegistry | None = None        # the adapters requests may name (None: LoRA off)
    reasoning: type | None = None            # the server's ReasoningParser (--reasoning-parser)
    state: str = STARTING
    open: dict[str, _Request] = field(default_factory=dict)
    _stats_waiters: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._ids = itertools.count()
        self._backend = None if self.tokenizer is None else backend_of(self.tokenizer)
        self.preparer = RequestPreparer(self.tokenizer, self.vocab_size, self.max_model_len,
                                        self.max_n, self.reasoning)
        self._stats_asked = False            # a StatsRequest is on its way to the engine
        self._pool: ThreadPoolExecutor | None = None    # tokenizes long prompts

    # --- requests -----------------------------------------------------------------------------

    def submit(self, req: GenerateRequest, deliver: Callable[[RequestOutput], None],
               fit_context: bool = False) -> str:
        """Queue a request; returns its id. RequestError (with an HTTP status) if refused.

        fit_context: refuse a prompt plus max_tokens beyond the context length instead of
        ending it there, and read max_tokens=None as "the rest of the context" (OpenAI's rule).
        """
        self._admit()
        return self._start(req, deliver, *self._prepared(req, fit_context))

    async def submit_async(self, req: GenerateRequest, deliver: Callable[[RequestOutput], None],
                           fit_context: bool = False) -> str:
        """submit(), with a long prompt tokenized in a thread while the event loop serves on."""
        if tokenizes_inline(req):
            return self.submit(req, deliver, fit_context)
        self._admit()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        prepared = await asyncio.get_running_loop().run_in_executor(
            self._pool, self._prepared, req, fit_context)
        self._admit()                        # the server may have stopped meanwhile
        return self._start(req, deliver, *prepared)

    def _admit(self) -> None:
        if self.state != READY:
            raise RequestError(f"the server is {self.state}", 503)
        if self.max_open is not None and len(self.open) >= self.max_open:
            raise RequestError(f"the server is at its cap of {self.max_open} open requests", 429)

    def _prepared(self, req: GenerateRequest, fit_context: bool):
        """RequestPreparer.prepare() and the request's adapter, their refusals as RequestErrors:
        a ValueError is the client's mistake (400), anything else a failure of this request
        alone (500, logged)."""
        try:
            lora = self.resolve_lora(req.options.lora)
            return (*self.preparer.prepare(req, fit_context), lora)
        except ValueError as e:
            raise RequestError(str(e)) from None
        except Exception as e:
            log.exception("preparing request %r failed", req.id)
            raise RequestError(f"the request could not be prepared: {type(e).__name__}: {e}",
                               500) from None

    def _start(self, req: GenerateRequest, deliver: Callable[[RequestOutput], None],
               text: str | None, token_ids: list[int], params: SamplingParams,
               lora: LoRARequest | None) -> str:
        rid = f"{self.id_prefix}{next(self._ids)}"
        arrival = time.time()
        want_logprobs = params.logprobs is not None
        output = RequestOutput(req.id, text, token_ids, [], metrics=RequestMetrics(arrival),
                               prompt_logprobs=None if params.prompt_logprobs is None else [None])
        samples = []
        for i in range(params.n):
            c = CompletionOutput(i, cumulative_logprob=0.0 if want_logprobs else None,
                                 logprobs=[] if want_logprobs else None)
            output.outputs.append(c)
            samples.append(_Sample(c, IncrementalDetokenizer(
                self.tokenizer, token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output, params.min_tokens)))
        r = self.open[rid] = _Request(output, samples, deliver, req.stream)
        if self.timeout_s is not None:
            r.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, rid)
        for i in range(params.n):
            self.send(AddRequest(id=f"{rid}/{i}", token_ids=token_ids,
                                 sampling=_sample_params(params, i), options=req.options,
                                 arrival=arrival, lora=lora))
        return rid

    def resolve_lora(self, name: str | None) -> LoRARequest | None:
        """The adapter a request names (None: the base model), or ValueError."""
        if name is None:
            return None
        if self.loras is None:
            raise ValueError(f"lora {name!r}: LoRA adapters are not enabled on this engine "
                             f"(--enable-lora)")
        return self.loras.resolve(name)

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
        r = self.open[rid]
        running = [i for i, s in enumerate(r.samples) if not s.out.finished]
        if running and self.state != DEAD:
            self.send(Abort(ids=[f"{rid}/{i}" for i in running], reason="abort"))
        for i in running:
            c = r.samples[i].out
            c.finish_reason, c.error, c.error_code = reason, error, code
        if reply:
            self._reply(rid, r)
        else:
            self._close(rid)

    # --- engine outputs -----------------------------------------------------------------------

    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        now = time.time()
        updated: dict[str, _Request] = {}
        stopped = []
        failed: dict[str, str] = {}
        for o in outputs:
            rid, _, index = o.id.rpartition("/")
            r = self.open.get(rid)
            if r is None or rid in failed:
                continue
            try:
                if self._fold(r, int(index), o, now, stopped):
                    updated[rid] = r
            except Exception as e:            # the detokenizer's, say: this request fails alone
                log.exception("request %s: reading its output failed", rid)
                failed[rid] = f"reading the engine's output failed: {type(e).__name__}: {e}"
        if stopped:
            self.send(Abort(ids=stopped, reason="stop"))
        for rid, error in failed.items():
            updated.pop(rid, None)
            if rid in self.open:
                self._end(rid, "error", error, 500)
        for rid, r in updated.items():
            if rid in self.open:
                self._reply(rid, r)

    def _fold(self, r: _Request, index: int, o: TokenOutput, now: float,
              stopped: list[str]) -> bool:
        """Fold one sample's TokenOutput into its request; False if there is nothing new."""
        s, metrics = r.samples[index], r.output.metrics
        if o.prompt_logprobs and r.output.prompt_logprobs is not None:
            r.output.prompt_logprobs.extend(map(self._logprobs, o.prompt_logprobs))
        if o.stats is not None and index == 0:
            metrics.first_scheduled_time = o.stats.first_scheduled or None
            metrics.num_cached_tokens = o.stats.num_cached_tokens
            metrics.num_preemptions = o.stats.num_preemptions
        if o.stats is not None and o.finish_reason is not None:
            metrics.num_draft_tokens += o.stats.num_draft_tokens
            metrics.num_accepted_tokens += o.stats.num_accepted_tokens
        c = s.out
        if c.finish_reason is not None:  # ended here by a stop string; the engine catches up
            return False
        taken = 0
        if o.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if s.last_token_time and self.metrics is not None:
                self.metrics.inter_token(now - s.last_token_time)
            s.last_token_time = now
            ids = o.new_token_ids
            # NOTE: the EOS or stop token that ended the sample is in token_ids but not in the
            # text (as in vLLM), unless include_stop_str_in_output
            text_ids = ids[:-1] if o.finish_reason == "stop" and not s.detok.include_stop else ids
            taken = s.detok.push(text_ids)              # those after a stop string are dropped
            if taken == len(text_ids):
                taken = len(ids)
            c.token_ids += ids[:taken]
        if o.logprobs and c.logprobs is not None:
            for lp in o.logprobs[:taken]:
                c.logprobs.append(self._logprobs(lp))
                c.cumulative_logprob += lp.logprobs[0]
        if s.detok.stopped_by is not None:
            c.finish_reason, c.stop_reason = "stop", s.detok.stopped_by
            stopped.append(o.id)
        elif o.finish_reason is not None:
            s.detok.flush()
            c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
            c.error, c.error_code = o.error, o.error_code
        c.text = s.detok.text
        return True

    def _reply(self, rid: str, r: _Request) -> None:
        """Deliver what is new: the whole output once finished, or (streams) a delta."""
        finished = all(s.out.finish_reason is not None for s in r.samples)
        if not r.stream:
            if finished:
                r.deliver(self._finish(r))
                self._close(rid)
            return
        deltas = []
        for s in r.samples:
            c = s.out
            if s.sent < 0:                   # its end was delivered already
                continue
            text = s.detok.stream(final=c.finish_reason is not None)
            if len(c.token_ids) == s.sent and not text and c.finish_reason is None:
                continue
            deltas.append(CompletionOutput(
                c.index, text, c.token_ids[s.sent:], None,
                None if c.logprobs is None else c.logprobs[s.sent:],
                c.finish_reason, c.stop_reason, c.error, c.error_code))
            s.sent = -1 if c.finish_reason is not None else len(c.token_ids)
        if not deltas and not finished:
            return
        out = RequestOutput(r.output.request_id, outputs=deltas, finished=finished)
        if not r.sent_prompt:
            r.sent_prompt = True
            out.prompt, out.prompt_token_ids = r.output.prompt, r.output.prompt_token_ids
            out.prompt_logprobs = r.output.prompt_logprobs
        if finished:
            out.metrics = self._finish(r).metrics
        r.deliver(out)
        if finished:
            self._close(rid)

    def _finish(self, r: _Request) -> RequestOutput:
        out, m = r.output, r.output.metrics
        out.finished = True
        if m.finished_time is None:
            m.finished_time = time.time()
            m.num_output_tokens = sum(len(s.out.token_ids) for s in r.samples)
        return out

    def _close(self, rid: str) -> None:
        r = self.open.pop(rid)
        if r.timer is not None:
            r.timer.cancel()
        if self.metrics is not None:
            self.metrics.request_finished(self._finish(r))

    def _logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """One position's logprobs: the chosen token first, then the top-k."""
        texts = (self._backend.decode_batch([[t] for t in lp.token_ids])
                 if self._backend is not None else [None] * len(lp.token_ids))
        d: dict[int, Logprob] = {}
        for i, (tok, value, text) in enumerate(zip(lp.token_ids, lp.logprobs, texts)):
            if tok not in d:
                d[tok] = Logprob(value, lp.rank if i == 0 else i, text)
        return d

    # --- engine stats and the server's state --------------------------------------------------

    def request_stats(self, waiter: Callable[[Stats | None], None]) -> None:
        """waiter gets the engine's next Stats, or None if the engine is gone."""
        if self.state == DEAD:
            waiter(None)
            return
        self._stats_waiters.append(waiter)
        if not self._stats_asked:            # NOTE: one question at a time; every waiter
            self._stats_asked = True         # then gets the one answer
            self.send(StatsRequest())

    def on_stats(self, stats: Stats) -> None:
        self._stats_asked = False
        waiters, self._stats_waiters = self._stats_waiters, deque()
        for waiter in waiters:
            waiter(stats)

    def fail_all(self, reason: str, code: int = 503) -> None:
        """End every open request with an error (engine failure, or a drain that ran out)."""
        for rid in list(self.open):
            self._end(rid, "error", reason, code)
        while self._stats_waiters:
            self._stats_waiters.popleft()(None)
        self._stats_asked = False


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own seed, and prompt logprobs computed once."""
    if params.n == 1:
        return params
    changes = {"n": 1}
    if params.seed is not None:   # seed + index, wrapped to stay in 64 bits
        changes["seed"] = (params.seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
    if index > 0:
        changes["prompt_logprobs"] = None
    return msgspec.structs.replace(params, **changes)
