"""Where a launcher, a scheduler and its workers meet: ipc:// paths in the private runtime folder
when all run on one host; TCP on the launching host's address, under CurveZMQ, when workers run
on other hosts (--distributed-executor-backend ray), since those cannot reach its files.

A link is named as in shared/replicas.py (a worker's plans "worker-0", its replica's results
"results") or "control" (the workers' link to the launcher). For TCP the launcher draws a port
per name and two keypairs per instance: the server's, for the sockets that bind here (the
scheduler's and its own), and the workers'. They stay in memory: the scheduler gets them in its
spawn arguments, the workers through Ray. A binding socket admits the workers' public key only
(a ZAP handler), so a peer that reaches the port without the workers' secret key completes no
handshake, and what crosses the network is encrypted (docs/MULTI_NODE.md).
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import zmq

from conveyor.shared.sockets import Socket, ipc


@dataclass(frozen=True)
class TcpLinks:
    host: str                                # the launching host's address: what binds here
    ports: dict[str, int]                    # link name -> port; a name not here stays ipc://
    server_keys: tuple[bytes, bytes]         # (public, secret), z85: the binding sockets'
    worker_keys: tuple[bytes, bytes]         # (public, secret), z85: the connecting workers'
    # per replica: the torch.distributed rendezvous, tcp://IP:PORT on its rank 0's node
    rendezvous: tuple[str, ...] = ()

    @classmethod
    def draw(cls, host: str, names: list[str], rendezvous: tuple[str, ...]) -> TcpLinks:
        """Fresh ports on `host` (free now; bound by their owners at start) and keypairs."""
        return cls(host, {name: free_port(host) for name in names}, zmq.curve_keypair(),
                   zmq.curve_keypair(), rendezvous)

    def __repr__(self) -> str:                # secret keys stay out of logs and tracebacks
        return f"TcpLinks(host={self.host!r}, ports={self.ports!r})"


def free_port(host: str) -> int:
    """A TCP port nobody listens on at `host` now.

    NOTE: the port is closed again before its owner binds it; another program taking it in
    between makes that bind fail, and the start-up with it (no one is misdirected)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tcp(cfg, name: str) -> TcpLinks | None:
    links = cfg.links
    return links if links is not None and name in links.ports else None


def address(cfg, name: str) -> str:
    links = _tcp(cfg, name)
    if links is None:
        return ipc(cfg.runtime_dir, name)
    host = f"[{links.host}]" if ":" in links.host else links.host
    return f"tcp://{host}:{links.ports[name]}"


def bind(ctx: zmq.Context, kind: int, cfg, name: str, **kwargs) -> Socket:
    """The binding end of link `name` (the scheduler's, the launcher's). For a TCP link the
    context must admit the workers first (admit_workers)."""
    links = _tcp(cfg, name)
    keys = links.server_keys if links is not None else None
    return Socket(ctx, kind, address(cfg, name), bind=True, curve_keys=keys, **kwargs)


def connect(ctx: zmq.Context, kind: int, cfg, name: str, **kwargs) -> Socket:
    """The connecting end of link `name` (a worker's)."""
    links = _tcp(cfg, name)
    if links is None:
        return Socket(ctx, kind, address(cfg, name), bind=False, **kwargs)
    return Socket(ctx, kind, address(cfg, name), bind=False, curve_keys=links.worker_keys,
                  curve_server_key=links.server_keys[0], **kwargs)


class _WorkersOnly:
    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def admit_workers(ctx: zmq.Context, cfg):
    """A ZAP handler on `ctx` that lets only the instance's workers complete a CurveZMQ
    handshake; the caller stops it when done. None (nothing to guard) without TCP links."""
    if cfg.links is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("conveyor.zap"))
    auth.start()
    auth.configure_curve_callback(domain="*",
                                  credentials_provider=_WorkersOnly(cfg.links.worker_keys[0]))
    return auth
