"""A frontend's router over data-parallel replicas: which scheduler each engine request goes to.

It stands where a FrontendCore sends its messages (`send`) and where the schedulers' answers
come in (`on_message`), so the one request path stays as it is. A request's samples (ids
`<rid>/<i>`, sent one after another) all go to the replica its first sample went to, and so do
its aborts. The policies:

- `round_robin`: the live replicas in turn.
- `least_loaded`: the live replica with the fewest of this frontend's open sequences.
- `prefix_affinity`: the prompt's first PREFIX_BLOCKS KV blocks (and its adapter) pick a replica
  by rendezvous hashing, so a repeated prefix lands where its blocks are cached and a dead
  replica moves only its own prefixes; unless that replica holds more than MAX_IMBALANCE
  sequences beyond the least loaded, which then gets it (SGLang's cache-aware router idea).

Loads are this frontend's view (sequences it sent that have not finished). A dead replica's
open sequences end with an error saying so; the others keep serving. A StatsRequest asks every
live replica and answers once all have, with their sums and each replica's own Stats.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import msgspec

from conveyor.shared.messages.engine import (
    Abort,
    AddRequest,
    Stats,
    StatsRequest,
    TokenOutput,
    TokenOutputs,
)

PREFIX_BLOCKS = 4        # KV blocks of the prompt that decide its replica
MAX_IMBALANCE = 8        # open sequences beyond the least loaded replica before affinity yields
_SUMMED = [f.name for f in msgspec.structs.fields(Stats)
           if f.type in (int, float) and f.name not in ("longest_wait_s",)]


class Router:
    def __init__(self, sends: list[Callable[[object], None]], policy: str, block_size: int,
                 on_outputs: Callable[[list[TokenOutput]], None],
                 on_stats: Callable[[Stats], None]):
        self.sends = sends                   # replica r's socket send
        self.policy, self.block_size = policy, block_size
        self.on_outputs, self.on_stats = on_outputs, on_stats
        self.dead: dict[int, str] = {}       # replica -> why it died
        self.open: list[set[str]] = [set() for _ in sends]   # open sequence ids per replica
        self.where: dict[str, int] = {}      # request id -> its replica
        self.samples: dict[str, int] = {}    # request id -> its open sequences
        self._turn = itertools.count()
        self._stats: dict[int, Stats | None] = {}   # replies awaited (None) or received

    @property
    def live(self) -> list[int]:
        return [r for r in range(len(self.sends)) if r not in self.dead]

    def load(self, replica: int) -> int:
        return len(self.open[replica])

    # --- frontend -> schedulers ---------------------------------------------------------------

    def send(self, msg) -> None:
        if isinstance(msg, AddRequest):
            rid = msg.id.rpartition("/")[0]
            r = self.where.get(rid)
            if r is None:
                r = self.where[rid] = self.choose(msg)
            if r in self.dead:               # a sample of a request whose replica just died
                self.on_outputs([_failed(msg.id, self.dead[r])])
                return
            self.open[r].add(msg.id)
            self.samples[rid] = self.samples.get(rid, 0) + 1
            self.sends[r](msg)
        elif isinstance(msg, Abort):
            by_replica: dict[int, list[str]] = {}
            for sid in msg.ids:
                r = self.where.get(sid.rpartition("/")[0])
                if r is not None and r not in self.dead:
                    by_replica.setdefault(r, []).append(sid)
            for r, ids in by_replica.items():
                self.sends[r](Abort(ids=ids, reason=msg.reason))
        elif isinstance(msg, StatsRequest):
            self._stats = dict.fromkeys(self.live)
            for r in self.live:
                self.sends[r](msg)
        else:
            raise TypeError(f"no replica takes a {type(msg).__name__}")

    def choose(self, msg: AddRequest) -> int:
        live = self.live
        if not live:
            return next(iter(self.dead))     # fails at once in send
        least = min(live, key=self.load)
        if self.policy == "round_robin":
            return live[next(self._turn) % len(live)]
        if self.policy == "least_loaded":
            return least
        blocks = min(PREFIX_BLOCKS, len(msg.token_ids) // self.block_size)
        if blocks == 0:                      # not a whole block: nothing to reuse anywhere
            return least
        key = _prefix_key(msg.token_ids[:blocks * self.block_size],
                          msg.lora.lora_name if msg.lora is not None else "")
        home = max(live, key=lambda r: hashlib.blake2b(key + r.to_bytes(4, "little"),
                                                       digest_size=8).digest())
        return least if self.load(home) > self.load(least) + MAX_IMBALANCE else home

    # --- schedulers -> frontend ---------------------------------------------------------------

    def on_message(self, replica: int, msg) -> None:
        if isinstance(msg, TokenOutputs):
            self._finished(replica, [o.id for o in msg.outputs if o.finish_reason is not None])
            self.on_outputs(msg.outputs)
        elif isinstance(msg, Stats):
            if replica in self._stats:
                self._stats[replica] = msgspec.structs.replace(msg, replica=replica)
                self._answer_stats()
        else:
            raise RuntimeError(f"unreadable message from replica {replica}: {msg}")

    def replica_dead(self, replica: int, reason: str) -> None:
        """Replica `replica` is gone: its open sequences fail; new requests go elsewhere."""
        if replica in self.dead:
            return
        self.dead[replica] = reason
        ids = sorted(self.open[replica])
        self._finished(replica, ids)
        if ids:
            self.on_outputs([_failed(sid, reason) for sid in ids])
        if replica in self._stats:
            del self._stats[replica]
            self._answer_stats()

    def _finished(self, replica: int, ids: list[str]) -> None:
        for sid in ids:
            if sid not in self.open[replica]:
                continue
            self.open[replica].remove(sid)
            rid = sid.rpartition("/")[0]
            self.samples[rid] -= 1
            if not self.samples[rid]:
                del self.samples[rid], self.where[rid]

    def _answer_stats(self) -> None:
        if any(s is None for s in self._stats.values()):
            return
        replies = [self._stats[r] for r in sorted(self._stats)]
        self._stats = {}
        self.on_stats(merge_stats(replies, len(self.sends), self.dead))


def merge_stats(replies: list[Stats], num_replicas: int, dead: dict[int, str]) -> Stats:
    """The server's Stats: sums over the live replicas, and each replica's own."""
    total = Stats(replicas=replies, dead_replicas=sorted(dead),
                  integrity_ok=all(s.integrity_ok for s in replies),
                  longest_wait_s=max((s.longest_wait_s for s in replies), default=0.0))
    for name in _SUMMED:
        setattr(total, name, sum(getattr(s, name) for s in replies))
    caps = [s.queue_cap for s in replies if s.queue_cap is not None]
    total.queue_cap = sum(caps) if caps else None
    return total


def _prefix_key(token_ids: list[int], lora: str) -> bytes:
    return lora.encode() + b"\0" + b"".join(t.to_bytes(4, "little") for t in token_ids)


def _failed(sid: str, reason: str) -> TokenOutput:
    return TokenOutput(sid, [], finish_reason="error", error=reason, error_code=503)
