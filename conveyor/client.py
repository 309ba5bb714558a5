"""The ZMQ client library for `conveyor serve`: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Hello", SamplingParams(max_tokens=20)).outputs[0].text)
        c.generate("Hi", priority=-1, ttft_slo=0.5)     # RequestOptions (docs/SCHEDULING.md)

A prompt is text, token ids, or chat messages ([{"role": ..., "content": ...}]). Results are the
offline API's RequestOutput (conveyor/outputs.py): whole from `generate`, deltas from `stream`.
Breaking out of a stream, closing the client or cancelling a task aborts the request on the
server, which frees its KV blocks. A lost connection raises ServerError, then and on every later
call: make a new client. The wire protocol is in docs/PROTOCOL.md.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from conveyor.outputs import RequestOutput
from conveyor.shared.messages import MAX_MESSAGE_BYTES, MessageError, decode, encode
from conveyor.shared.messages.client import CancelRequest, ErrorReply, GenerateRequest
from conveyor.shared.messages.engine import Stats, StatsRequest
from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams

_REPLIES = (RequestOutput, ErrorReply, Stats)


class ServerError(RuntimeError):
    """The server rejected a request, or the connection to it was lost."""


def build_request(request_id: str, prompt, params: SamplingParams | None, stream: bool,
                  options: dict) -> GenerateRequest:
    """ValueError for options that are not RequestOptions' fields or not valid."""
    try:
        opts = RequestOptions(**options)
    except TypeError as e:
        raise ValueError(str(e)) from None
    req = GenerateRequest(id=request_id, sampling=params or SamplingParams(), stream=stream,
                          options=opts)
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and all(isinstance(m, dict) for m in prompt):
        req.messages = list(prompt)
    else:
        req.prompt_token_ids = list(prompt)
    return req


def is_batch(prompts) -> bool:
    """A list of prompts (texts, token id lists or conversations), not one prompt."""
    return isinstance(prompts, (list, tuple)) and bool(prompts) and not isinstance(
        prompts[0], (int, dict))


def _curve_keys(server_public_key, client_key) -> tuple[bytes, bytes, bytes] | None:
    """(server public, client public, client secret) for a CurveZMQ client, or None."""
    if server_public_key is None:
        if client_key is not None:
            raise ValueError("client_key needs server_public_key (CurveZMQ)")
        return None
    if isinstance(server_public_key, (str, Path)):
        server_public_key, _ = zmq.auth.load_certificate(server_public_key)
    if client_key is None:
        return server_public_key, *zmq.curve_keypair()
    public, secret = zmq.auth.load_certificate(client_key)
    if secret is None:
        raise ValueError(f"client_key {client_key} holds no secret key: pass the "
                         f"NAME.key_secret file that zmq.auth.create_certificates wrote")
    return server_public_key, public, secret


def _socket(ctx: zmq.Context, address: str, server_public_key,
            client_key=None) -> tuple[zmq.Socket, zmq.Socket]:
    """The connected DEALER socket and the monitor socket that reports its disconnects."""
    curve = _curve_keys(server_public_key, client_key)     # bad keys raise before any socket
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 64)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    # NOTE: the monitor comes first: a refused handshake disconnects once, for good (no
    # reconnect), and can do so before connect()'s caller gets to run again
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    return sock, monitor


def _close_socket(sock: zmq.Socket, monitor: zmq.Socket, linger_ms: int) -> None:
    """Close _socket()'s pair. NOTE: the monitor is stopped first, else Context.term() waits
    forever (in the garbage collector's case, in whatever thread the collection runs)."""
    sock.disable_monitor()
    monitor.close(0)
    sock.close(linger=linger_ms)


def _drop(client) -> None:
    """Close a client that was dropped without close()."""
    sock = getattr(client, "_sock", None)
    if sock is not None and not sock.closed:
        _close_socket(sock, client._monitor, 0)
        client._ctx.term()


def _check_connected(lost: str | None) -> None:
    """Raise if the connection is gone: a lost one never comes back (see _socket)."""
    if lost:
        raise ServerError(lost)


def _decode_reply(frames: list[bytes]):
    try:
        return decode(frames, _REPLIES)
    except MessageError as e:
        raise ServerError(f"unreadable reply from the server: {e}") from None


class Client:
    """A blocking client. Not thread-safe: use one per thread (or AsyncClient)."""

    def __init__(self, address: str, *, server_public_key: bytes | str | Path | None = None,
                 client_key: str | Path | None = None, timeout: float | None = None):
        """server_public_key: the server's CurveZMQ public key (or its server.key file);
        client_key: this client's NAME.key_secret certificate, for a server that admits only
        the clients in its DIR/clients (default: a fresh keypair); timeout: seconds to wait
        for a reply, or for room to send, before TimeoutError (default: no limit)."""
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sock, self._monitor = _socket(self._ctx, address, server_public_key, client_key)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._send_poller = zmq.Poller()        # room to send, or the connection lost
        self._send_poller.register(self._sock, zmq.POLLOUT)
        self._send_poller.register(self._monitor, zmq.POLLIN)
        self._ids = itertools.count()
        self._inbox: dict[str, deque] = {}      # request id -> replies not yet read
        self._stats: deque = deque()
        self._lost: str | None = None           # why the connection is gone, once it is

    def generate(self, prompts, sampling_params: SamplingParams | None = None, **options):
        """One prompt -> RequestOutput; a list of prompts -> a list, run concurrently.
        options: RequestOptions' fields (priority, ttft_slo, tpot_slo, cache_salt, lora: a
        LoRA adapter's name)."""
        batch = prompts if is_batch(prompts) else [prompts]
        ids = []
        try:
            for p in batch:     # one by one: a send that fails cancels those before it
                ids.append(self._send(p, sampling_params, False, options))
            results = [self._next(i) for i in ids]
        finally:
            self._cancel([i for i in ids if i in self._inbox])
        return results if is_batch(prompts) else results[0]

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               **options) -> Iterator[RequestOutput]:
        """Yield RequestOutput deltas as the server produces them; leaving early cancels the
        request."""
        rid = self._send(prompt, sampling_params, True, options)
        try:
            while True:
                msg = self._next(rid, remove=False)
                yield msg
                if msg.finished:
                    del self._inbox[rid]
                    return
        finally:
            self._cancel([rid] if rid in self._inbox else [])

    def stats(self) -> Stats:
        self._put(StatsRequest())
        while not self._stats:
            self._receive()
        return self._stats.popleft()

    def close(self) -> None:
        if self._sock.closed:
            return
        self._cancel(list(self._inbox))
        _close_socket(self._sock, self._monitor, 500)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        _drop(self)

    def _send(self, prompt, params, stream: bool, options: dict) -> str:
        rid = f"r{next(self._ids)}"
        msg = build_request(rid, prompt, params, stream, options)
        self._put(msg)
        self._inbox[rid] = deque()
        return rid

    def _put(self, msg) -> None:
        """Send msg, waiting for room no longer than for a reply. NOTE: a DEALER whose
        connection is gone cannot take a frame, so a plain send would block forever."""
        frames = encode(msg)
        while True:
            if self._monitor.poll(0):
                self._lose()
            _check_connected(self._lost)
            try:
                return self._sock.send_multipart(frames, zmq.DONTWAIT)
            except zmq.Again:
                if not self._send_poller.poll(self._wait_ms()):
                    raise TimeoutError(f"could not send to {self.address} in "
                                       f"{self.timeout} s") from None

    def _wait_ms(self) -> int | None:
        return None if self.timeout is None else int(self.timeout * 1000)

    def _lose(self) -> None:
        parse_monitor_message(self._monitor.recv_multipart())
        self._lost = f"lost the connection to {self.address}"

    def _cancel(self, ids: list[str]) -> None:
        for rid in ids:
            self._inbox.pop(rid, None)
            if self._lost:
                continue
            try:        # clean-up never blocks
                self._sock.send_multipart(encode(CancelRequest(rid)), zmq.DONTWAIT)
            except zmq.Again:
                pass    # no connection (or 1,000 frames queued): the request runs to its end

    def _next(self, rid: str, remove: bool = True) -> RequestOutput:
        while not self._inbox[rid]:
            self._receive()
        msg = self._inbox[rid].popleft()
        if isinstance(msg, ErrorReply):
            del self._inbox[rid]
            raise ServerError(msg.error)
        if remove:
            del self._inbox[rid]
        return msg

    def _receive(self) -> None:
        start = time.monotonic()
        events = dict(self._poller.poll(0 if self._lost else self._wait_ms()))
        # NOTE: replies already received are read before a disconnect is believed.
        if self._sock not in events:
            if self._monitor in events:
                self._lose()
            _check_connected(self._lost)
            raise TimeoutError(f"no reply from {self.address} in "
                               f"{time.monotonic() - start:.1f} s")
        msg = _decode_reply(self._sock.recv_multipart())
        if isinstance(msg, Stats):
            self._stats.append(msg)
        elif isinstance(msg, ErrorReply) and msg.id is None:
            raise ServerError(msg.error)      # a frame of ours the server could not read
        elif _reply_id(msg) in self._inbox:
            self._inbox[_reply_id(msg)].append(msg)


class AsyncClient:
    """The same as Client, in asyncio; many requests may run concurrently on one client."""

    def __init__(self, address: str, *, server_public_key: bytes | str | Path | None = None,
                 client_key: str | Path | None = None):
        self.address = address
        self._ctx = zmq.asyncio.Context()
        self._sock, self._monitor = _socket(self._ctx, address, server_public_key, client_key)
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats: deque[asyncio.Future] = deque()
        self._reader: asyncio.Task | None = None
        self._lost: str | None = None

    async def generate(self, prompts, sampling_params: SamplingParams | None = None,
                       **options):
        if is_batch(prompts):
            return list(await asyncio.gather(*(
                self.generate(p, sampling_params, **options) for p in prompts)))
        rid, queue = self._send(prompts, sampling_params, False, options)
        try:
            return self._check(await queue.get())
        finally:
            self._finish(rid)

    async def stream(self, prompt, sampling_params: SamplingParams | None = None,
                     **options) -> AsyncIterator[RequestOutput]:
        """Leaving early cancels the request (wrap in contextlib.aclosing to do it at once)."""
        rid, queue = self._send(prompt, sampling_params, True, options)
        try:
            while True:
                msg = self._check(await queue.get())
                yield msg
                if msg.finished:
                    self._queues.pop(rid, None)
                    return
        finally:
            self._finish(rid)

    async def stats(self) -> Stats:
        _check_connected(self._lost)          # the reader has stopped: nothing would answer
        self._start_reader()
        future = asyncio.get_running_loop().create_future()
        self._stats.append(future)
        self._sock.send_multipart(encode(StatsRequest()))   # not awaited: see _send
        return self._check(await future)

    def close(self) -> None:
        if self._sock.closed:
            return
        for rid in list(self._queues):
            self._finish(rid)
        if self._reader is not None:
            self._reader.cancel()
        _close_socket(self._sock, self._monitor, 500)

    def __del__(self) -> None:
        _drop(self)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def _send(self, prompt, params, stream: bool, options: dict) -> tuple[str, asyncio.Queue]:
        _check_connected(self._lost)
        rid = f"r{next(self._ids)}"
        msg = build_request(rid, prompt, params, stream, options)
        self._start_reader()
        queue = self._queues[rid] = asyncio.Queue()
        # NOTE: not awaited: with the connection gone the send never completes, and the
        # reader answers the queue with the loss instead
        self._sock.send_multipart(encode(msg))
        return rid, queue

    def _finish(self, rid: str) -> None:
        """Forget rid; if the server may still be working on it, cancel it there."""
        if self._queues.pop(rid, None) is not None and not self._sock.closed and not self._lost:
            self._sock.send_multipart(encode(CancelRequest(rid)))

    @staticmethod
    def _check(msg):
        if isinstance(msg, ErrorReply):
            raise ServerError(msg.error)
        return msg

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if self._monitor in events and self._sock not in events:
                parse_monitor_message(await self._monitor.recv_multipart())
                self._lost = f"lost the connection to {self.address}"
                for queue in self._queues.values():
                    queue.put_nowait(ErrorReply(None, self._lost))
                while self._stats:
                    self._stats.popleft().set_result(ErrorReply(None, self._lost))
                return
            if self._sock in events:
                try:
                    msg = _decode_reply(await self._sock.recv_multipart())
                except ServerError:
                    continue                  # unreadable: nobody to give it to
                if isinstance(msg, Stats) or (isinstance(msg, ErrorReply) and msg.id is None):
                    if self._stats:
                        self._stats.popleft().set_result(msg)
                elif _reply_id(msg) in self._queues:
                    self._queues[_reply_id(msg)].put_nowait(msg)


def _reply_id(msg: RequestOutput | ErrorReply) -> str | None:
    return msg.request_id if isinstance(msg, RequestOutput) else msg.id
