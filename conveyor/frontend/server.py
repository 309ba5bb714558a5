"""A frontend process: the public ZMQ endpoint of the engine (docs/PROTOCOL.md).

Clients (DEALERs) talk to a ROUTER on tcp://host:zmq_port+index. The frontend tokenizes (chat
templates too), sends AddRequests to the scheduler, detokenizes the TokenOutputs that come back,
aborts sequences a stop string ended, and answers each client with GenerateOutputs: one per step
when streaming, else one when the request is done. An EngineDead from the launcher fails every
open request with finish_reason "error".
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

import zmq

from conveyor.frontend.tokenizer import apply_chat_template, check_token_ids, load_tokenizer
from conveyor.frontend.tracker import RequestTracker, sub_id
from conveyor.outputs import PositionLogprobs
from conveyor.shared.config import ServeConfig
from conveyor.shared.messages import (
    Abort,
    CancelRequest,
    Completion,
    EngineDead,
    ErrorReply,
    GenerateOutput,
    GenerateRequest,
    Logprob,
    Ready,
    Shutdown,
    Stats,
    StatsRequest,
    TokenOutputs,
)
from conveyor.shared.model_files import read_model_config, resolve_model
from conveyor.shared.process import StartupError
from conveyor.shared.sockets import Socket, ipc, load_curve_keys

log = logging.getLogger(__name__)


def frontend_main(ctx: zmq.Context, control: Socket, cfg: ServeConfig, index: int) -> None:
    files = resolve_model(cfg.engine.model)
    server = FrontendServer(load_tokenizer(files, cfg.engine.tokenizer),
                            read_model_config(files).vocab_size, f"f{index}-")
    curve = load_curve_keys(cfg.zmq_curve_keys) if cfg.zmq_curve_keys else None
    port = cfg.zmq_port + index if cfg.zmq_port else "*"
    address = f"tcp://{cfg.host}:{port}"
    try:
        server.clients = Socket(ctx, zmq.ROUTER, address, bind=True,
                                allowed=(GenerateRequest, CancelRequest, StatsRequest),
                                curve_keys=curve)
    except zmq.ZMQError as e:
        raise StartupError(f"cannot listen on {address}: {e}") from None
    server.scheduler = Socket(ctx, zmq.DEALER, ipc(cfg.runtime_dir, "scheduler"), bind=False,
                              identity=f"frontend-{index}".encode(), allowed=(TokenOutputs, Stats))
    server.control = Socket(ctx, zmq.PULL, ipc(cfg.runtime_dir, f"frontend-{index}"), bind=True,
                            allowed=(EngineDead, Shutdown))
    control.send(Ready(f"frontend-{index}", {"address": server.clients.address}))
    server.run()


@dataclass
class _Open:
    peer: bytes
    client_id: str
    stream: bool
    sent_tokens: list[int] = field(default_factory=list)   # per sample: token ids sent so far
    sent_prompt: bool = False


class FrontendServer:
    def __init__(self, tokenizer, vocab_size: int, id_prefix: str):
        self.tokenizer = tokenizer
        self.id_prefix = id_prefix                          # keeps ids unique across frontends
        self.vocab_size = vocab_size
        self.tracker = RequestTracker(tokenizer)
        self.open: dict[str, _Open] = {}                    # request id -> its client
        self.by_client: dict[tuple[bytes, str], str] = {}   # (peer, client's id) -> request id
        self.stats_waiters: deque[bytes] = deque()
        self._ids = itertools.count()
        self.clients: Socket
        self.scheduler: Socket
        self.control: Socket

    def run(self) -> None:
        poller = zmq.Poller()
        for s in (self.clients, self.scheduler, self.control):
            poller.register(s.sock, zmq.POLLIN)
        reason = "the server is shutting down"
        try:
            while True:
                events = dict(poller.poll())
                if self.control.sock in events:
                    _, msg = self.control.recv()
                    reason = msg.reason if isinstance(msg, (EngineDead, Shutdown)) else reason
                    return
                if self.scheduler.sock in events:
                    while self.scheduler.sock.poll(0):
                        self._on_scheduler(self.scheduler.recv()[1])
                if self.clients.sock in events:
                    while self.clients.sock.poll(0):
                        self._on_client(*self.clients.recv())
        finally:
            self._fail_all(reason)
            self.clients.close(linger_ms=2000)

    # --- clients ------------------------------------------------------------------------------

    def _on_client(self, peer: bytes, msg) -> None:
        if isinstance(msg, GenerateRequest):
            try:
                self._add(peer, msg)
            except ValueError as e:
                self.clients.send(ErrorReply(msg.id, str(e)), to=peer)
        elif isinstance(msg, CancelRequest):
            rid = self.by_client.get((peer, msg.id))
            if rid is not None:
                req = self.tracker.requests[rid]
                ids = [sub_id(rid, i) for i, s in enumerate(req.seqs) if not s.out.finished]
                self.scheduler.send(Abort(ids=ids, reason="abort"))
                self._close(rid)
        elif isinstance(msg, StatsRequest):
            self.stats_waiters.append(peer)
            self.scheduler.send(msg)
        else:                                    # ErrorReply: the frame was malformed
            self.clients.send(msg, to=peer)

    def _add(self, peer: bytes, msg: GenerateRequest) -> None:
        if (peer, msg.id) in self.by_client:
            raise ValueError(f"request id {msg.id!r} is already in use")
        text, token_ids = self._tokenize(msg)
        if msg.sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        rid = f"{self.id_prefix}{next(self._ids)}"
        adds = self.tracker.add(rid, text, token_ids, msg.sampling, msg.priority)
        self.open[rid] = _Open(peer, msg.id, msg.stream, [0] * len(adds))
        self.by_client[(peer, msg.id)] = rid
        for add in adds:
            self.scheduler.send(add)

    def _tokenize(self, msg: GenerateRequest) -> tuple[str | None, list[int]]:
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

    # --- scheduler ----------------------------------------------------------------------------

    def _on_scheduler(self, msg) -> None:
        if isinstance(msg, Stats):
            if self.stats_waiters:
                self.clients.send(msg, to=self.stats_waiters.popleft())
            return
        if not isinstance(msg, TokenOutputs):
            raise RuntimeError(f"unreadable message from the scheduler: {msg}")
        updated, stopped = self.tracker.process(msg.outputs)
        if stopped:
            self.scheduler.send(Abort(ids=stopped, reason="stop"))
        for rid in updated:
            if rid in self.open:
                self._reply(rid)

    def _reply(self, rid: str) -> None:
        req, o = self.tracker.requests[rid], self.open[rid]
        finished = req.output.finished
        if not o.stream and not finished:
            return
        outputs = []
        for i, seq in enumerate(req.seqs):
            c = seq.out
            text = self.tracker.stream_delta(rid, i) if o.stream else c.text
            start = o.sent_tokens[i] if o.stream else 0
            if start == len(c.token_ids) and not text and not (finished and o.stream):
                continue
            outputs.append(Completion(
                i, text, c.token_ids[start:],
                None if c.logprobs is None else [_wire_logprobs(p) for p in c.logprobs[start:]],
                c.finish_reason, c.stop_reason, c.error))
            o.sent_tokens[i] = len(c.token_ids)
        if not outputs and not finished:
            return
        out = GenerateOutput(o.client_id, outputs, finished)
        if not o.sent_prompt:
            out.prompt_token_ids, o.sent_prompt = req.output.prompt_token_ids, True
        self.clients.send(out, to=o.peer)
        if finished:
            self._close(rid)

    def _close(self, rid: str) -> None:
        o = self.open.pop(rid)
        del self.by_client[(o.peer, o.client_id)]
        self.tracker.pop(rid)

    def _fail_all(self, reason: str) -> None:
        for rid in list(self.open):
            req, o = self.tracker.requests[rid], self.open[rid]
            outputs = [Completion(i, finish_reason="error", error=reason)
                       for i, s in enumerate(req.seqs) if not s.out.finished]
            self.clients.send(GenerateOutput(o.client_id, outputs, True), to=o.peer)
            self._close(rid)
        while self.stats_waiters:
            self.clients.send(ErrorReply(None, reason), to=self.stats_waiters.popleft())


def _wire_logprobs(position: PositionLogprobs) -> list[Logprob]:
    return [Logprob(tok, lp.logprob, lp.rank or 0, lp.decoded_token)
            for tok, lp in position.items()]

