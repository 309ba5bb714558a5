"""The codec of every message that crosses a process boundary; the messages live one module per
link:

  client    <-> frontend  : client.py (and outputs.RequestOutput, the replies)
  frontend  <-> scheduler : engine.py
  scheduler <-> workers   : worker.py
  launcher  <-> children  : control.py

Messages are msgspec Structs encoded as msgpack. On the wire a message is two frames: a one-byte
type tag, then the msgpack body. Decoding checks the tag, the size and the schema, so a malformed
frame becomes a `MessageError`, never a crash and never arbitrary objects (no pickle anywhere).
"""
from __future__ import annotations

import msgspec

from conveyor.outputs import RequestOutput
from conveyor.shared.messages.client import CancelRequest, ErrorReply, GenerateRequest
from conveyor.shared.messages.control import (
    Drain,
    Drained,
    EngineDead,
    FrontendDead,
    Ready,
    ReplicaDead,
    Shutdown,
)
from conveyor.shared.messages.engine import Abort, AddRequest, Stats, StatsRequest, TokenOutputs
from conveyor.shared.messages.worker import StepPlan, StepResult

# NOTE: a type's tag is its position here plus one; clients depend on tags 9-14, so they never
# change: new types are appended.
MESSAGE_TYPES: tuple[type, ...] = (
    AddRequest, Abort, TokenOutputs, StepPlan, StepResult, Ready, Shutdown, EngineDead, Stats,
    GenerateRequest, CancelRequest, StatsRequest, RequestOutput, ErrorReply, Drain, Drained,
    FrontendDead, ReplicaDead,
)
_TAG = {cls: bytes([i + 1]) for i, cls in enumerate(MESSAGE_TYPES)}
_DECODERS = {bytes([i + 1]): msgspec.msgpack.Decoder(cls) for i, cls in enumerate(MESSAGE_TYPES)}
_ENCODER = msgspec.msgpack.Encoder()
MAX_MESSAGE_BYTES = 64 << 20


class MessageError(ValueError):
    """A frame that is not a valid message: wrong tag, too large, or not matching its schema."""


def encode(msg) -> list[bytes]:
    return [_TAG[type(msg)], _ENCODER.encode(msg)]


def decode(frames: list[bytes], allowed: tuple[type, ...] = MESSAGE_TYPES,
           max_bytes: int = MAX_MESSAGE_BYTES):
    if len(frames) != 2:
        raise MessageError(f"expected 2 frames (tag, body), got {len(frames)}")
    tag, body = bytes(frames[0]), frames[1]
    decoder = _DECODERS.get(tag)
    if decoder is None or decoder.type not in allowed:
        raise MessageError(f"unexpected message tag {tag!r}")
    if len(body) > max_bytes:
        raise MessageError(f"message of {len(body)} bytes exceeds the cap of {max_bytes}")
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise MessageError(f"malformed {decoder.type.__name__}: {e}") from None
    except RecursionError:  # msgspec skips unknown fields by recursion: a deep one exhausts it
        raise MessageError(f"malformed {decoder.type.__name__}: nested too deeply") from None


def through_wire(msg):
    """msg encoded and decoded again: what an in-process channel hands over, so the engine in
    one process gets exactly what it would get from a socket."""
    return decode(encode(msg), (type(msg),))
