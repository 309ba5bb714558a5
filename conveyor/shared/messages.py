"""Every message that crosses a process boundary, and their codec.

Messages are msgspec Structs encoded as msgpack. On the wire a message is two frames: a one-byte
type tag, then the msgpack body. Decoding checks the tag, the size and the schema, so a malformed
frame becomes a `MessageError`, never a crash and never arbitrary objects (no pickle anywhere).

Flow (see docs/ARCHITECTURE.md; the client protocol is in docs/PROTOCOL.md):
  client    -> frontend  : GenerateRequest, CancelRequest, StatsRequest
  frontend  -> client    : GenerateOutput, ErrorReply, Stats
  frontend  -> scheduler : AddRequest, Abort, StatsRequest
  scheduler -> frontend  : TokenOutputs, Stats
  scheduler -> workers   : StepPlan (deltas: a sequence is sent whole once, then only what changed)
  worker 0  -> scheduler : StepResult
  launcher <-> children  : Ready, EngineDead, Shutdown, Drain, Drained (control)
  launcher  -> scheduler : FrontendDead
"""
from __future__ import annotations

import math

import msgspec

from conveyor.shared.sampling_params import SamplingParams

# --- frontend <-> scheduler -------------------------------------------------------------------

class AddRequest(msgspec.Struct, kw_only=True):
    id: str
    token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0                        # lower runs first (the priority policy)
    ttft_slo: float | None = None            # latency objectives in seconds (GenerateRequest)
    tpot_slo: float | None = None
    arrival: float = 0.0                     # time.time() when the frontend accepted it
    cache_salt: str | None = None            # prefix-cache blocks are shared only with this salt


class Abort(msgspec.Struct, kw_only=True):
    ids: list[str]
    reason: str = "abort"                    # "abort" (client went away) or "stop" (stop string)


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top-k (rank order)."""
    token_ids: list[int]
    logprobs: list[float]
    rank: int                                # rank of the chosen token among all (1 = most likely)


class RequestStats(msgspec.Struct, array_like=True, omit_defaults=True):
    arrival: float = 0.0
    first_scheduled: float = 0.0
    first_token: float = 0.0
    num_cached_tokens: int = 0
    num_preemptions: int = 0


class TokenOutput(msgspec.Struct, omit_defaults=True):
    id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None          # one per new token
    prompt_logprobs: list[TokenLogprobs] | None = None   # new prompt positions, in order
    finish_reason: str | None = None         # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None     # the stop token id that ended it, if any
    error: str | None = None
    error_code: int | None = None            # with "error": 400 invalid, 429 overloaded, 500 failed
    stats: RequestStats | None = None        # sent with the first token and when finished


class TokenOutputs(msgspec.Struct):
    outputs: list[TokenOutput]


# --- scheduler <-> workers --------------------------------------------------------------------

class NewSeq(msgspec.Struct, array_like=True):
    """A sequence the worker has not seen in this slot: sent once, whole."""
    slot: int
    token_ids: list[int]                     # prompt, plus output so far when resumed
    prompt_len: int                          # tokens of the original prompt (for penalties)
    sampling: SamplingParams
    block_ids: list[int]
    num_computed: int                        # tokens whose KV is already in the blocks (prefix hit)


class SeqStep(msgspec.Struct, array_like=True):
    """What one sequence does in a step."""
    slot: int
    num_tokens: int                          # tokens to compute from its num_computed on
    new_block_ids: list[int]                 # appended to its block table before the step
    sample: bool                             # sample after this chunk (last prompt chunk, decode)
    prompt_logprobs_from: int = -1           # first prompt position to return logprobs for, or -1


class StepPlan(msgspec.Struct):
    step: int
    new: list[NewSeq]                        # new or resumed sequences, before `seqs` is run
    seqs: list[SeqStep]                      # the batch, in order
    freed: list[int]                         # slots whose sequences ended or were preempted


class StepResult(msgspec.Struct):
    step: int
    sampled: list[int]                       # one token per SeqStep with sample=True, in order
    logprobs: list[TokenLogprobs | None]     # parallel to `sampled`; None where not asked
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]]]  # (slot, positions from its _from)


# --- control ----------------------------------------------------------------------------------

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


class Stats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    integrity_ok: bool = True
    longest_wait_s: float = 0.0              # age of the oldest waiting request (0: none waits)
    queue_cap: int | None = None             # waiting requests beyond this are refused (429)
    # sequences whose latency objective was judged, and those that missed it
    ttft_slo_judged: int = 0
    ttft_slo_missed: int = 0
    tpot_slo_judged: int = 0
    tpot_slo_missed: int = 0
    # filled in by the frontend that answers a client's StatsRequest, about itself
    frontend_open_requests: int = 0          # requests it still owes an answer
    frontend_tracked_requests: int = 0       # requests in its tracker (equal when all is well)


# --- client <-> frontend (the public ZMQ protocol, docs/PROTOCOL.md) -------------------------

class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                      omit_defaults=True):
    """Exactly one of prompt, prompt_token_ids and messages is set."""
    id: str                                  # chosen by the client, unique among its open requests
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None   # chat: [{"role": ..., "content": ...}]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False                     # True: a GenerateOutput per step with the new text
    priority: int = 0                        # lower runs first (the priority policy)
    cache_salt: str | None = None            # share prefix-cache blocks only with this salt
    ttft_slo: float | None = None            # objective: seconds from arrival to the first token
    tpot_slo: float | None = None            # objective: mean seconds per output token after it

    def __post_init__(self) -> None:
        for name in ("ttft_slo", "tpot_slo"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class CancelRequest(msgspec.Struct):
    id: str


class StatsRequest(msgspec.Struct):
    pass


class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int
    text: str | None = None


class Completion(msgspec.Struct, omit_defaults=True):
    """One of the n samples: whole when not streaming, else what is new since the last output."""
    index: int
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[list[Logprob]] | None = None   # per token: the chosen one first, then top-k
    finish_reason: str | None = None         # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: int | None = None            # HTTP-style class of the error: 400, 429, 500, 503


class GenerateOutput(msgspec.Struct, omit_defaults=True):
    id: str
    outputs: list[Completion]
    finished: bool = False
    prompt_token_ids: list[int] | None = None   # in the first output of a request


class ErrorReply(msgspec.Struct):
    id: str | None                           # None: the frame could not be read at all
    error: str
    code: int = 400                          # HTTP-style: 400 invalid, 429 overloaded, 503 down


# --- codec ------------------------------------------------------------------------------------

# NOTE: a type's tag is its position here plus one; append only, clients depend on the tags.
MESSAGE_TYPES: tuple[type, ...] = (
    AddRequest, Abort, TokenOutputs, StepPlan, StepResult, Ready, Shutdown, EngineDead, Stats,
    GenerateRequest, CancelRequest, StatsRequest, GenerateOutput, ErrorReply, Drain, Drained,
    FrontendDead,
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
