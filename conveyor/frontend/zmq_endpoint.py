"""The ZMQ client endpoint of a frontend: one ROUTER socket, its client connections, and what
each of them may cost (docs/PROTOCOL.md, docs/SECURITY.md).

Every connection (a ROUTER peer) is tracked with its open requests, by the client's own ids.
Per connection: at most MAX_OPEN_PER_CLIENT open requests (more get ErrorReply 429) and one
StatsRequest at a time (another gets ErrorReply 429). Replies are sent without waiting: once
ZMQ's high-water mark (1000 messages) is queued for a client that does not read, the ROUTER
drops its replies, so such a client holds bounded memory and never blocks the others. The
reader yields to the event loop after every message, so one client's flood cannot starve HTTP,
the engine's outputs or the other clients. A connection that closes has its open requests
aborted, as HTTP does for a client that goes away: each message carries the file descriptor of
the connection it came by (ZMQ_SRCFD), and the socket monitor reports that descriptor when the
connection closes.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from conveyor.frontend.core import FrontendCore, RequestError
from conveyor.frontend.prepare import tokenizes_inline
from conveyor.outputs import RequestOutput
from conveyor.shared.messages.client import CancelRequest, ErrorReply, GenerateRequest
from conveyor.shared.messages.engine import Stats, StatsRequest
from conveyor.shared.sockets import Socket

log = logging.getLogger(__name__)
MAX_OPEN_PER_CLIENT = 4096     # open requests of one connection


@dataclass(eq=False)
class _Peer:
    fd: int                                  # the connection's socket, for its disconnect event
    # the client's id -> engine request id, or the task still tokenizing its prompt
    requests: dict[str, str | asyncio.Task] = field(default_factory=dict)
    wants_stats: bool = False


class ZmqEndpoint:
    def __init__(self, sock: Socket, core: FrontendCore):
        self.sock, self.core = sock, core
        self.peers: dict[bytes, _Peer] = {}
        self.by_fd: dict[int, set[bytes]] = {}
        self._monitor = sock.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # NOTE: events are read through a plain (blocking-API) view of the monitor socket, so
        # that the reader can take those already queued before it handles a message: a closed
        # connection's descriptor may be reused by the next one, whose messages must not be
        # mistaken for the old client's
        self._events = zmq.Socket.shadow(self._monitor.underlying)
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        """Read and handle client messages, forever."""
        watcher = asyncio.ensure_future(self._watch())
        try:
            while True:
                peer, msg, fd = await self.sock.recv_async_with_fd()
                self._read_events()
                try:
                    self._handle(peer, msg, fd)
                except Exception as e:       # a bug must cost this message, not the frontend
                    log.exception("handling a client message failed")
                    self._send(peer, ErrorReply(getattr(msg, "id", None),
                                                f"internal error: {type(e).__name__}", 500))
                await asyncio.sleep(0)       # let the rest of the loop run between messages
        finally:
            watcher.cancel()
            for task in self._tasks:
                task.cancel()
            self._monitor.close(0)

    # --- connections --------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await self._monitor.poll()
            self._read_events()

    def _read_events(self) -> None:
        while self._events.poll(0):
            event = parse_monitor_message(self._events.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for peer in self.by_fd.pop(int(event["value"]), ()):
                    self._gone(peer)

    def _peer(self, peer: bytes, fd: int) -> _Peer:
        p = self.peers.get(peer)
        if p is None:
            p = self.peers[peer] = _Peer(fd)
            self.by_fd.setdefault(fd, set()).add(peer)
        return p

    def _gone(self, peer: bytes) -> None:
        """The connection closed: abort its requests (nobody can receive their replies)."""
        p = self.peers.pop(peer, None)
        if p is None:
            return
        for rid in p.requests.values():
            if isinstance(rid, str):
                self.core.cancel(rid)
        p.requests.clear()                   # a prompt still tokenizing sees it and cancels

    # --- messages -----------------------------------------------------------------------------

    def _handle(self, peer: bytes, msg, fd: int) -> None:
        if isinstance(msg, ErrorReply):      # the frame was malformed
            self._send(peer, msg)
            return
        p = self._peer(peer, fd)
        if isinstance(msg, GenerateRequest):
            self._generate(peer, p, msg)
        elif isinstance(msg, CancelRequest):
            rid = p.requests.pop(msg.id, None)
            if isinstance(rid, str):
                self.core.cancel(rid)
        elif isinstance(msg, StatsRequest):
            if p.wants_stats:
                self._send(peer, ErrorReply(None, "this connection already waits for Stats; "
                                                  "send the next StatsRequest after the reply",
                                            429))
                return
            p.wants_stats = True
            self.core.request_stats(lambda stats: self._send_stats(peer, p, stats))

    def _generate(self, peer: bytes, p: _Peer, msg: GenerateRequest) -> None:
        if msg.id in p.requests:
            self._send(peer, ErrorReply(msg.id, f"request id {msg.id!r} is already in use"))
            return
        if len(p.requests) >= MAX_OPEN_PER_CLIENT:
            self._send(peer, ErrorReply(msg.id, f"this connection has {MAX_OPEN_PER_CLIENT} "
                                                f"open requests, the most one may have", 429))
            return
        deliver = lambda out: self._deliver(peer, p, msg.id, out)   # noqa: E731
        if tokenizes_inline(msg):
            try:
                p.requests[msg.id] = self.core.submit(msg, deliver)
            except RequestError as e:
                self._send(peer, ErrorReply(msg.id, str(e), e.code))
            return
        task = p.requests[msg.id] = asyncio.ensure_future(self._submit_later(peer, p, msg, deliver))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _submit_later(self, peer: bytes, p: _Peer, msg: GenerateRequest, deliver) -> None:
        """Submit a request whose long prompt is tokenized in a thread; the client may cancel it
        or leave meanwhile (then its entry is no longer this task)."""
        me = asyncio.current_task()
        try:
            rid = await self.core.submit_async(msg, deliver)
        except RequestError as e:
            if p.requests.get(msg.id) is me:
                del p.requests[msg.id]
                self._send(peer, ErrorReply(msg.id, str(e), e.code))
            return
        if p.requests.get(msg.id) is me:
            p.requests[msg.id] = rid
        else:
            self.core.cancel(rid)

    def _deliver(self, peer: bytes, p: _Peer, client_id: str, out: RequestOutput) -> None:
        self._send(peer, out)
        if out.finished:
            p.requests.pop(client_id, None)

    def _send_stats(self, peer: bytes, p: _Peer, stats: Stats | None) -> None:
        p.wants_stats = False
        if self.peers.get(peer) is not p:
            return
        if stats is None:
            self._send(peer, ErrorReply(None, "the engine is not running", 503))
            return
        stats.frontend_open_requests = len(self.core.open)
        self._send(peer, stats)

    def _send(self, peer: bytes, msg) -> None:
        self.sock.send(msg, to=peer)
