"""Paged KV block allocation with ref counts and a prefix cache.

Blocks are handed out from a free queue; a full block whose KV is computed is registered under a
chained sha256 of (parent hash, its token ids), so a later request with the same prefix reuses
it; a hit is confirmed by comparing the tokens. The chain starts at a root made from the
instance's salt, the request's cache_salt and its LoRA adapter's id, so requests with different
salts (tenants) or adapters never share a block. With a hash key the hashes are HMAC-SHA256
under it, unpredictable from outside.
Freed cached blocks stay findable until the free queue hands them out again (LRU).
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from conveyor.scheduler.request import Request


class IntegrityError(AssertionError):
    """The block or request bookkeeping broke an invariant (a bug, never a user error)."""


def block_hash(parent: bytes, token_ids: Sequence[int], extra: bytes = b"",
               key: bytes | None = None) -> bytes:
    """The chained hash of one full block; `parent` is the previous block's hash (or a root)."""
    h = hashlib.sha256(parent) if key is None else hmac.new(key, parent, hashlib.sha256)
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None                   # set while registered in the cache
        self.token_ids: tuple[int, ...] | None = None    # kept to verify a hash hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 salt: bytes = b"", hash_key: bytes | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.hash_key = hash_key
        self._root = block_hash(b"conveyor-prefix-cache", (), salt, hash_key)
        # (cache_salt, adapter id) -> its chain's root
        self._salted_roots: dict[tuple[str | None, int], bytes] = {}
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: holds exactly the blocks with ref_count 0; the front is handed out first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}              # block hash -> block id
        self.prefix_cache_queries = 0                    # tokens looked up
        self.prefix_cache_hits = 0                       # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of `req`; takes no refs.

        NOTE: only blocks that end before the last known token count, so a fully cached prompt
        still computes its last block (at least its last token) and the worker gets its logits.
        """
        if not self.enable_prefix_caching:
            return []
        num_blocks = (req.num_tokens - 1) // self.block_size
        self._hash_blocks(req, num_blocks)
        hits = []
        for i in range(num_blocks):
            block_id = self._cached.get(req.block_hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != self._tokens(req, i):
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, req: Request, num_new_tokens: int, prefix: Sequence[int] = (),
                     reserve: int = 0) -> bool:
        """Whether `req` can cover num_new_tokens more tokens (after `prefix`, the blocks from
        `lookup` for a request holding none) and still leave `reserve` blocks free."""
        return self.num_needed(req, num_new_tokens, prefix) + reserve <= len(self._free)

    def num_needed(self, req: Request, num_new_tokens: int, prefix: Sequence[int] = ()) -> int:
        """Free blocks `req` takes to cover num_new_tokens more tokens (see can_allocate)."""
        if not prefix:                # a running request (every step): no prefix to count
            held, start, revived = len(req.block_table), req.num_computed_tokens, 0
        else:
            held, start = len(prefix), len(prefix) * self.block_size
            revived = sum(self.blocks[b].ref_count == 0 for b in prefix)
        return max(0, -(-(start + num_new_tokens) // self.block_size) - held) + revived

    def num_exclusive(self, req: Request) -> int:
        """Blocks of `req` no other request holds: those freeing it returns to the free queue."""
        return sum(self.blocks[b].ref_count == 1 for b in req.block_table)

    def allocate_prefix(self, req: Request, prefix: Sequence[int]) -> int:
        """Take refs on the cached `prefix` blocks for a request holding none; returns (and sets
        as num_computed_tokens) the number of cached tokens."""
        if req.block_table:
            raise ValueError(f"request {req.id} already holds blocks")
        for block_id in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        req.block_table.extend(prefix)
        req.num_cached_blocks = len(prefix)
        req.num_computed_tokens = len(prefix) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += req.num_computed_tokens
        return req.num_computed_tokens

    def allocate(self, req: Request, num_new_tokens: int) -> list[int]:
        """Grow the block table to cover num_computed_tokens + num_new_tokens; returns the new
        block ids. Raises MemoryError where `can_allocate` said no."""
        needed = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        new = needed - len(req.block_table)
        if new <= 0:                  # most decode steps: the last block has room
            return []
        if new > len(self._free):
            raise MemoryError(f"{new} blocks needed, {len(self._free)} free")
        ids = [self._pop_free() for _ in range(new)]
        req.block_table.extend(ids)
        return ids

    def cache_full_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Register the blocks of `req` that became full of computed tokens: of its first
        num_tokens tokens (default num_computed_tokens), which must all be known."""
        if not self.enable_prefix_caching:
            return
        if num_tokens is None:
            num_tokens = req.num_computed_tokens
        num_full = num_tokens // self.block_size
        if num_full <= req.num_cached_blocks:     # no block filled up since (most steps)
            return
        self._hash_blocks(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            block = self.blocks[req.block_table[i]]
            h = req.block_hashes[i]
            # NOTE: first writer wins; a duplicate of a cached block stays private and uncached.
            if block.hash is None and h not in self._cached:
                block.hash, block.token_ids = h, self._tokens(req, i)
                self._cached[h] = block.id
        req.num_cached_blocks = max(req.num_cached_blocks, num_full)

    def trim(self, req: Request) -> None:
        """Free the blocks of `req` past its last computed token (those that held only
        rejected guesses of speculative decoding); they are private and hold no cached content."""
        keep = -(-req.num_computed_tokens // self.block_size)
        while len(req.block_table) > keep:
            block = self.blocks[req.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.id] = None
                if block.hash is None:
                    self._free.move_to_end(block.id, last=False)

    def free(self, req: Request) -> None:
        """Drop the refs of `req` on its blocks, tail first; it then holds none and has no
        computed tokens."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    # NOTE: a block without cached content goes to the front: reuse it before
                    # evicting anything a later prefix could hit. Cached ones queue at the back,
                    # tail blocks of a sequence ahead of its head (they are worth less).
                    self._free.move_to_end(block_id, last=False)
        req.block_table.clear()
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0

    def check_integrity(self, tables: Iterable[Sequence[int]]) -> None:
        """Raise IntegrityError unless the state is consistent with `tables`, the block table of
        every request holding blocks."""
        refs: Counter[int] = Counter()
        for table in tables:
            if len(set(table)) != len(table):
                raise IntegrityError(f"a block table holds a block twice: {list(table)}")
            refs.update(table)
        for block in self.blocks:
            if block.ref_count != refs[block.id]:
                raise IntegrityError(f"block {block.id} has ref_count {block.ref_count} but "
                                     f"{refs[block.id]} tables hold it")
            if (block.ref_count == 0) != (block.id in self._free):
                raise IntegrityError(f"block {block.id} (ref_count {block.ref_count}) is "
                                     f"{'' if block.id in self._free else 'not '}in the free queue")
            if block.hash is not None and self._cached.get(block.hash) != block.id:
                raise IntegrityError(f"block {block.id} has a hash the cache does not map to it")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].hash != h:
                raise IntegrityError(f"cache entry for block {block_id} has a stale hash")
        if len(self._free) + sum(b.ref_count > 0 for b in self.blocks) != self.num_blocks:
            raise IntegrityError("free queue and held blocks do not add up to the pool")

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:                     # evict its cached content
            del self._cached[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def _hash_blocks(self, req: Request, num_blocks: int) -> None:
        """Extend req.block_hashes to its first num_blocks full blocks."""
        hashes = req.block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else self._root_of(
                req.options.cache_salt, req.lora.lora_int_id if req.lora is not None else 0)
            hashes.append(block_hash(parent, self._tokens(req, i), key=self.hash_key))

    def _root_of(self, cache_salt: str | None, lora_id: int) -> bytes:
        """The root of the chains of a salt and an adapter (0: the base model). NOTE: the
        adapter's KV differs from the base's from the first layer on, so its id is part of
        every hash of its blocks."""
        if cache_salt is None and not lora_id:
            return self._root
        root = self._salted_roots.get((cache_salt, lora_id))
        if root is None:
            if len(self._salted_roots) >= 4096:         # a bounded memo, not a registry
                self._salted_roots.clear()
            salt = b"" if cache_salt is None else b"s" + cache_salt.encode()
            extra = struct.pack("<q", lora_id) + salt
            root = block_hash(self._root, (), extra, self.hash_key)
            self._salted_roots[cache_salt, lora_id] = root
        return root

    def _tokens(self, req: Request, i: int) -> tuple[int, ...]:
        return tuple(req.token_ids[i * self.block_size:(i + 1) * self.block_size])
