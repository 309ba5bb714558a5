"""launcher <-> children: start-up, drain, failure and shutdown."""
from __future__ import annotations

import msgspec


class Ready(msgspec.Struct):
    role: str
    info: dict[str, int | float | str] = {}


class Shutdown(msgspec.Struct):
    reason: str = ""


class EngineDead(msgspec.Struct):
    reason: str
    role: str = ""                           # the child that failed, when a child reports it


class Drain(msgspec.Struct):
    """launcher -> frontend: refuse new requests; end open ones within timeout_s, then Drained."""
    timeout_s: float


class Drained(msgspec.Struct):
    """frontend -> launcher: no open request is left (after Drain or EngineDead)."""
    role: str


class FrontendDead(msgspec.Struct):
    """launcher -> scheduler: this frontend died; abort its requests (nobody can get them)."""
    role: str


class ReplicaDead(msgspec.Struct):
    """launcher -> frontend: this data-parallel replica died; fail its requests, route around it."""
    replica: int
    reason: str
