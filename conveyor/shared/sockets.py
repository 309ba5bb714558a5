"""One ZeroMQ socket helper for every process: typed messages in, typed messages out.

`Socket` wraps any socket type (PUSH, PULL, ROUTER, DEALER), binds or connects it, caps incoming
messages (ZMQ_MAXMSGSIZE) and decodes only the allowed types. A bad frame comes back as an
`ErrorReply` to answer or drop, never as an exception, and is logged: the first at once, then at
most one line every 10 s per socket with the count dropped since, so a client cannot flood the
log. Internal sockets are ipc:// paths in a private per-instance runtime directory.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from conveyor.shared.messages import MAX_MESSAGE_BYTES, MESSAGE_TYPES, MessageError, decode, encode
from conveyor.shared.messages.client import ErrorReply

log = logging.getLogger(__name__)

WARN_EVERY_S = 10.0       # at most one malformed-message warning per socket in this many seconds


class _WithId(msgspec.Struct):
    id: str


class Socket:
    def __init__(self, ctx: zmq.Context, kind: int, address: str, *, bind: bool,
                 allowed: tuple[type, ...] = MESSAGE_TYPES, identity: bytes | None = None,
                 max_bytes: int = MAX_MESSAGE_BYTES, curve_keys: tuple[bytes, bytes] | None = None,
                 curve_server_key: bytes | None = None):
        """curve_keys: this socket's CurveZMQ (public, secret) keys: a server's (clients must
        know the public key), or with curve_server_key (the server's public key) a client's."""
        self.sock = ctx.socket(kind)
        self.kind = kind
        self.allowed = allowed
        self.max_bytes = max_bytes
        self._warned_at = float("-inf")
        self._unlogged = 0                   # malformed messages dropped since the last warning
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + 64)
        self.sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.ROUTER:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # a gone peer's replies are dropped
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        if curve_keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = curve_keys
            if curve_server_key is None:
                self.sock.curve_server = True
            else:
                self.sock.curve_serverkey = curve_server_key
        if bind:
            self.sock.bind(address)
        else:
            self.sock.connect(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else address

    def send(self, msg, to: bytes | None = None) -> None:
        self.send_frames(encode(msg), to)

    def send_frames(self, frames: list[bytes], to: bytes | None = None) -> None:
        self.sock.send_multipart([to, *frames] if to is not None else frames, copy=False)

    def recv(self, flags: int = 0) -> tuple[bytes | None, object]:
        """(sender identity on a ROUTER, else None; the message or an ErrorReply saying why not)."""
        return self._decode(self.sock.recv_multipart(flags, copy=True))

    async def recv_async(self) -> tuple[bytes | None, object]:
        """recv() for a socket made from a zmq.asyncio context."""
        return self._decode(await self.sock.recv_multipart(copy=True))

    async def recv_async_with_fd(self) -> tuple[bytes | None, object, int]:
        """recv_async(), and the file descriptor of the connection the message came by
        (ZMQ_SRCFD): on a ROUTER, which client connection sent it."""
        frames = await self.sock.recv_multipart(copy=False)
        fd = frames[-1].get(zmq.SRCFD)
        return (*self._decode([f.bytes for f in frames]), fd)

    def _decode(self, frames: list[bytes]) -> tuple[bytes | None, object]:
        peer = frames.pop(0) if self.kind == zmq.ROUTER else None
        try:
            return peer, decode(frames, self.allowed, self.max_bytes)
        except MessageError as e:
            self._warn(e)
            return peer, ErrorReply(_request_id(frames), str(e))

    def _warn(self, error: MessageError) -> None:
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last warning)" if self._unlogged else ""
        log.warning("dropped a malformed message on %s: %s%s", self.address, error, more)
        self._warned_at, self._unlogged = now, 0

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger_ms)


def _request_id(frames: list[bytes]) -> str | None:
    if len(frames) != 2:
        return None
    try:
        return msgspec.msgpack.decode(frames[1], type=_WithId).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def tcp_listener(host: str, port: int, reuse_addr: bool = True,
                 reuse_port: bool = True) -> socket.socket:
    """A bound TCP socket, not yet listening. With SO_REUSEPORT every frontend can listen on one
    port (the kernel spreads connections over them).

    NOTE: accepted connections inherit TCP_NODELAY, so a response is never held back by Nagle's
    algorithm waiting for the client's delayed ACK (40 ms a keep-alive response); and the socket
    names its protocol (IPPROTO_TCP), without which asyncio does not set TCP_NODELAY itself."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                              flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse_addr))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
        sock.bind(info[4])
    except OSError:
        sock.close()
        raise
    return sock


def reserve_shared_port(host: str, port: int) -> socket.socket:
    """Hold `port` (0: a free one) for this instance's frontends to share; OSError if in use.

    NOTE: SO_REUSEPORT lets any socket of the same user that sets it join a port. So the port is
    first probed without it (SO_REUSEADDR only, so old TIME_WAIT connections don't matter): that
    fails if anyone holds the port, this reservation included, which has SO_REUSEPORT but not
    SO_REUSEADDR; and port 0 then gets a port nobody holds, never another group's."""
    with tcp_listener(host, port, reuse_port=False) as probe:
        port = probe.getsockname()[1]
    return tcp_listener(host, port, reuse_addr=False)


RUNTIME_PREFIX = "conveyor-"
OWNER_FILE = "launcher.pid"                 # in a runtime directory: "<pid> <start time>"


def make_runtime_dir() -> Path:
    """A fresh private (0700) directory for this instance's ipc:// socket files, naming its
    launcher (this process) so that a later start can tell when it is stale."""
    path = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX))
    (path / OWNER_FILE).write_text(_process_stamp(os.getpid()) or "")
    return path


def remove_stale_runtime_dirs() -> list[Path]:
    """Remove the runtime directories of this user's launchers that are gone (SIGKILL leaves
    them behind: sockets, metrics files); returns them. A directory is stale when the process
    it names has exited, or its pid now belongs to a process started at another time. One made
    in another PID namespace (a container sharing /tmp) is not judged."""
    removed = []
    here = _pid_namespace("self")
    for path in Path(tempfile.gettempdir()).glob(f"{RUNTIME_PREFIX}*"):
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            stamp = (path / OWNER_FILE).read_text()
        except OSError:
            continue                         # not ours, or made by a version without the file
        fields = stamp.split()
        if len(fields) != 3 or not fields[0].isdigit() or here is None or fields[2] != here:
            continue
        if _process_stamp(int(fields[0])) != stamp:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _process_stamp(pid: int) -> str | None:
    """"<pid> <start time in clock ticks since boot> <pid namespace>", or None if there is no
    such process (or no /proc: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    namespace = _pid_namespace(str(pid))
    return None if namespace is None else f"{pid} {start} {namespace}"


def _pid_namespace(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def remove_runtime_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ipc(runtime_dir: str | Path, name: str) -> str:
    return f"ipc://{Path(runtime_dir) / name}"


def authorized_clients(folder: str | Path) -> Path | None:
    """folder/clients if it exists: then only clients whose public key is in one of its *.key
    certificates may connect (read at start)."""
    clients = Path(folder) / "clients"
    return clients if clients.is_dir() else None


def load_curve_keys(folder: str | Path) -> tuple[bytes, bytes]:
    """The server keypair in folder (server.key, server.key_secret), created there if missing."""
    import zmq.auth

    folder = Path(folder)
    secret = folder / "server.key_secret"
    if not secret.is_file():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        zmq.auth.create_certificates(folder, "server")
    public, secret_key = zmq.auth.load_certificate(secret)
    return public, secret_key
