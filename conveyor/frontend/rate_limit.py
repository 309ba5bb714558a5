"""The rate limit: a token bucket per client key, shared by every frontend process of a server.

A key's rate and burst hold for the server as a whole (per API key, as the README says), on
whichever frontend its connections land. The buckets live in one small file in the server's
private runtime directory, mapped into every frontend's memory and updated under an flock (two
system calls a request). A slot is (16-byte digest of the key, tokens, time of the last update
on the system-wide monotonic clock); a key hashes to a slot and probes the next PROBES. A slot
whose bucket has refilled is as good as empty and is reused, so the table never needs sweeping;
if every probed slot is in use, the fullest is given to the new key (which then starts with a
full bucket: the only way a key can get more than its burst, with over 16,000 slots).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
import time
from pathlib import Path

SLOTS = 1 << 14
PROBES = 16
_SLOT = struct.Struct("=16sdd")              # digest, tokens, stamp
_EMPTY = bytes(16)


class SharedBuckets:
    def __init__(self, rate: float, burst: float, path: str | Path | None = None):
        """path: the file the frontends share (created if missing); None: this process only."""
        self.rate, self.burst = rate, burst
        size = SLOTS * _SLOT.size
        if path is None:
            self.fd, self.map = None, mmap.mmap(-1, size)
            return
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)      # zeros: every slot empty
        self.map = mmap.mmap(self.fd, size)

    def take(self, key: str) -> float:
        """0.0 if a request of `key` may pass now (it takes a token), else the seconds until
        one may."""
        digest = hashlib.blake2b(key.encode(errors="replace"), digest_size=16).digest()
        first = int.from_bytes(digest[:8], "little") % SLOTS
        now = time.monotonic()
        with self._locked():
            slot, tokens, fullest = None, self.burst, (-1.0, first)
            for k in range(PROBES):
                i = (first + k) % SLOTS
                d, t, stamp = _SLOT.unpack_from(self.map, i * _SLOT.size)
                level = self.burst if d == _EMPTY else min(self.burst,
                                                           t + (now - stamp) * self.rate)
                if d == digest:
                    slot, tokens = i, level
                    break
                if level >= self.burst and slot is None:
                    slot = i                 # free for this key, unless it is further on
                fullest = max(fullest, (level, i))
            else:
                if slot is None:
                    slot = fullest[1]
            if tokens >= 1:
                tokens, wait = tokens - 1, 0.0
            else:
                wait = (1 - tokens) / self.rate
            _SLOT.pack_into(self.map, slot * _SLOT.size, digest, tokens, now)
        return wait

    @contextlib.contextmanager
    def _locked(self):
        if self.fd is None:
            yield
            return
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
