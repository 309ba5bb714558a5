"""Who may reach the ZMQ engine port: loopback by default; anywhere else, CurveZMQ clients named
in DIR/clients/ only, or the server does not start (docs/SECURITY.md).

The HTTP port has its API key; the engine port takes whole requests too, so it is never left
open beyond this host: bound to an address other than loopback (`--zmq-host`) it needs a
CurveZMQ keys folder (`--zmq-curve-keys DIR`, default `$CONVEYOR_CACHE/zmq-keys`) whose
`clients/` holds the public key of every client admitted. The server's keypair is created there
at start-up when missing (files 0600, folder 0700), and its public key is printed.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

from conveyor.shared.model_files import cache_dir
from conveyor.shared.sockets import authorized_clients, load_curve_keys


def default_keys_dir() -> Path:
    return cache_dir() / "zmq-keys"


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (an unresolvable name is not)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def secure_engine_port(host: str, curve_keys: str | None) -> tuple[str | None, str | None]:
    """(the CurveZMQ keys folder the port will use, or None; a line for the user, or None).
    ValueError saying why the port may not open as asked."""
    if is_loopback(host) and curve_keys is None:
        return None, None
    folder = Path(curve_keys) if curve_keys is not None else default_keys_dir()
    clients = authorized_clients(folder)
    admitted = sorted(clients.glob("*.key")) if clients is not None else []
    if not is_loopback(host) and not admitted:
        raise ValueError(
            f"the ZMQ engine port would listen on {host}, beyond this host, and admit any "
            f"client: put the public key (*.key) of each client to admit in {folder}/clients/ "
            f"(see docs/SECURITY.md), or keep --zmq-host at 127.0.0.1")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, _ = load_curve_keys(folder)      # created if missing
    for name in ("server.key", "server.key_secret"):
        os.chmod(folder / name, 0o600)
    os.chmod(folder, 0o700)
    who = (f"{len(admitted)} client key(s) from {clients}" if clients is not None else
           "any client that has the server's public key")
    return str(folder), (f"ZMQ engine port on {host} requires CurveZMQ: server public key "
                         f"{public.decode()} ({folder / 'server.key'}); admits {who}")
