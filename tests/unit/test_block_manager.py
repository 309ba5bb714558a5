"""BlockManager: block ids, ref counts, LRU eviction and the prefix cache, checked per call."""
from __future__ import annotations

import pytest

from conveyor.scheduler import block_manager
from conveyor.scheduler.block_manager import BlockManager, IntegrityError, block_hash
from conveyor.scheduler.request import Request
from conveyor.shared.request_options import RequestOptions
from conveyor.shared.sampling_params import SamplingParams


class Checked:
    """A BlockManager whose every method call is followed by a full integrity check over the
    requests that hold blocks."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.live: dict[int, Request] = {}

    def __getattr__(self, name):
        attr = getattr(self.bm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            result = attr(*args, **kwargs)
            if name in ("allocate", "allocate_prefix"):
                self.live[id(args[0])] = args[0]
            elif name == "free":
                self.live.pop(id(args[0]), None)
            self.bm.check_integrity([r.block_table for r in self.live.values()])
            return result
        return call


@pytest.fixture
def make_bm():
    def make(num_blocks=8, block_size=4, caching=True, salt=b"") -> Checked:
        return Checked(BlockManager(num_blocks, block_size, caching, salt))
    return make


def req(tokens, rid="r") -> Request:
    tokens = list(tokens)
    return Request(id=rid, token_ids=tokens, prompt_len=len(tokens), sampling=SamplingParams())


def admit(bm: Checked, r: Request) -> int:
    """Take the cached prefix of a request holding no blocks; returns its cached tokens."""
    return bm.allocate_prefix(r, bm.lookup(r))


def compute(bm: Checked, r: Request, n: int) -> list[int]:
    """Allocate for n more tokens, mark them computed and cache the full blocks."""
    new = bm.allocate(r, n)
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)
    return new


def ref_counts(bm: Checked, ids) -> list[int]:
    return [bm.blocks[i].ref_count for i in ids]


def test_blocks_are_handed_out_in_order(make_bm):
    bm = make_bm(num_blocks=8, block_size=4)
    a, b = req(range(10), "a"), req(range(100, 104), "b")
    assert bm.allocate(a, 10) == [0, 1, 2]
    assert bm.allocate(b, 4) == [3]
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2) == []              # still inside block 2
    assert bm.allocate(a, 3) == [4]             # token 12 opens a new block
    assert a.block_table == [0, 1, 2, 4]
    assert bm.num_free_blocks == 3
    assert bm.usage == pytest.approx(5 / 8)


def test_free_blocks_without_content_are_reused_first_in_order(make_bm):
    bm = make_bm(num_blocks=8, block_size=4, caching=False)
    a, b, c = req(range(12), "a"), req(range(4), "b"), req(range(20), "c")
    assert compute(bm, a, 12) == [0, 1, 2]
    assert compute(bm, b, 4) == [3]
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert ref_counts(bm, range(4)) == [0, 0, 0, 1]
    assert bm.allocate(c, 20) == [0, 1, 2, 4, 5]


def test_freed_cached_blocks_are_evicted_least_recently_freed_first(make_bm):
    bm = make_bm(num_blocks=6, block_size=4)
    a = req(range(12), "a")
    assert compute(bm, a, 12) == [0, 1, 2]
    assert bm.num_cached_blocks == 3
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3   # freed but still findable
    # Never-used blocks go first, then a's blocks tail first: 2, then 1, then 0.
    assert bm.allocate(req(range(50, 62), "c"), 12) == [3, 4, 5]
    assert bm.num_cached_blocks == 3
    assert bm.allocate(req(range(70, 72), "d"), 2) == [2]
    assert bm.num_cached_blocks == 2                                 # block 2's entry dropped
    again = req(list(range(12)) + [99], "a2")
    assert bm.lookup(again) == [0, 1]


def test_eviction_follows_the_order_of_frees(make_bm):
    bm = make_bm(num_blocks=4, block_size=4)
    a, b = req(range(8), "a"), req(range(10, 18), "b")
    assert compute(bm, a, 8) == [0, 1]
    assert compute(bm, b, 8) == [2, 3]
    bm.free(b)                                   # b first: its blocks are evicted first
    bm.free(a)
    assert bm.allocate(req(range(30, 38), "c"), 8) == [3, 2]
    assert bm.lookup(req(list(range(8)) + [1], "a2")) == [0, 1]
    assert bm.lookup(req(list(range(10, 18)) + [1], "b2")) == []


def test_shared_prefix_ref_counts(make_bm):
    bm = make_bm(num_blocks=8, block_size=4)
    a = req(range(1, 10), "a")                   # 9 tokens: blocks 0, 1 full, 2 partial
    assert compute(bm, a, 9) == [0, 1, 2]
    assert bm.num_cached_blocks == 2
    b = req(list(range(1, 9)) + [20, 21], "b")
    assert admit(bm, b) == 8
    assert b.block_table == [0, 1] and ref_counts(bm, [0, 1, 2]) == [2, 2, 1]
    assert compute(bm, b, 2) == [3]
    bm.free(a)
    assert ref_counts(bm, [0, 1, 2, 3]) == [1, 1, 0, 1]
    bm.free(b)
    assert ref_counts(bm, [0, 1, 2, 3]) == [0, 0, 0, 0]
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    c = req(list(range(1, 9)) + [5], "c")
    assert admit(bm, c) == 8                     # revived from the free queue
    assert ref_counts(bm, [0, 1]) == [1, 1] and bm.num_free_blocks == 6
    assert bm.prefix_cache_queries == 10 + 9 and bm.prefix_cache_hits == 16


def test_hash_hit_with_other_tokens_is_not_shared(make_bm, monkeypatch):
    monkeypatch.setattr(block_manager, "block_hash", lambda *args, **kwargs: b"\0" * 32)
    bm = make_bm(num_blocks=8, block_size=4)
    a = req([1, 2, 3, 4, 5], "a")
    compute(bm, a, 5)
    b = req([9, 9, 9, 9, 5], "b")                # same (forced) hash, other tokens
    assert bm.lookup(b) == []
    compute(bm, b, 5)                            # its block stays private: the hash is taken
    assert bm.num_cached_blocks == 1
    assert set(a.block_table).isdisjoint(b.block_table)
    c = req([1, 2, 3, 4, 7], "c")                # same tokens as a's cached block
    assert bm.lookup(c) == [a.block_table[0]]


def test_fully_cached_prompt_still_computes_its_last_block(make_bm):
    bm = make_bm(num_blocks=8, block_size=4)
    a = req(range(8), "a")
    compute(bm, a, 8)
    assert bm.num_cached_blocks == 2
    same = req(range(8), "same")
    assert admit(bm, same) == 4                  # block 1 holds the last token: recompute it
    assert same.num_remaining_tokens == 4
    assert compute(bm, same, 4) != [1]           # computed in a fresh block, not the shared one
    one_more = req(list(range(8)) + [8], "one_more")
    assert admit(bm, one_more) == 8
    assert one_more.num_remaining_tokens == 1


def test_prefix_caching_disabled(make_bm):
    bm = make_bm(caching=False)
    a = req(range(9), "a")
    compute(bm, a, 9)
    assert bm.num_cached_blocks == 0
    assert admit(bm, req(range(9), "b")) == 0
    assert bm.prefix_cache_queries == 0


def test_hashes_are_chained_and_salted():
    assert block_hash(b"p", [1, 2]) != block_hash(b"q", [1, 2])
    assert block_hash(b"p", [1, 2]) != block_hash(b"p", [2, 1])
    assert block_hash(b"p", [1, 2], b"tenant") != block_hash(b"p", [1, 2])
    assert len(block_hash(b"p", [1, 2])) == 32
    a, b = req(range(8), "a"), req(range(8), "b")
    BlockManager(4, 4, salt=b"one").lookup(a)
    BlockManager(4, 4, salt=b"two").lookup(b)
    assert len(a.block_hashes) == 1 and a.block_hashes != b.block_hashes


def test_keyed_hashes_are_unpredictable_and_per_instance():
    assert block_hash(b"p", [1, 2], key=b"k1") != block_hash(b"p", [1, 2])
    assert block_hash(b"p", [1, 2], key=b"k1") != block_hash(b"p", [1, 2], key=b"k2")
    a, b, c = req(range(8), "a"), req(range(8), "b"), req(range(8), "c")
    BlockManager(4, 4).lookup(a)
    BlockManager(4, 4, hash_key=b"x" * 32).lookup(b)
    BlockManager(4, 4, hash_key=b"y" * 32).lookup(c)
    assert len({a.block_hashes[0], b.block_hashes[0], c.block_hashes[0]}) == 3


@pytest.mark.parametrize("key", [None, b"k" * 32])
def test_cache_salts_never_share_blocks(key):
    """Tenants (cache salts) share blocks only within a salt; no salt is a tenant of its own."""
    bm = Checked(BlockManager(16, 4, hash_key=key))
    prompt = list(range(13))                                   # 3 full blocks + 1 token
    first = {}
    for salt in (None, "tenant-a", "tenant-b"):
        r = req(prompt, f"{salt}-1")
        r.options = RequestOptions(cache_salt=salt)
        assert admit(bm, r) == 0                               # nobody else's blocks
        compute(bm, r, 13)
        first[salt] = list(r.block_table)
        bm.free(r)
    for salt in (None, "tenant-a", "tenant-b"):
        r = req(prompt, f"{salt}-2")
        r.options = RequestOptions(cache_salt=salt)
        assert admit(bm, r) == 12                              # its own three blocks
        assert r.block_table == first[salt][:3]
        bm.free(r)
    assert len({tuple(t[:3]) for t in first.values()}) == 3


def test_lora_adapters_never_share_blocks():
    """The adapter's id roots its chains: the base, two adapters, and an adapter under a salt
    each compute their own KV for the same prompt; each reuses its own."""
    from conveyor.shared.lora import LoRARequest

    bm = Checked(BlockManager(32, 4))
    prompt = list(range(13))
    kinds = [(None, None), (LoRARequest("a", 1, "/a"), None), (LoRARequest("b", 2, "/b"), None),
             (LoRARequest("a", 1, "/a"), "tenant")]
    first = {}
    for i, (lora, salt) in enumerate(kinds):
        r = req(prompt, f"{i}-1")
        r.lora, r.options = lora, RequestOptions(cache_salt=salt)
        assert admit(bm, r) == 0
        compute(bm, r, 13)
        first[i] = list(r.block_table)
        bm.free(r)
    for i, (lora, salt) in enumerate(kinds):
        r = req(prompt, f"{i}-2")
        r.lora, r.options = lora, RequestOptions(cache_salt=salt)
        assert admit(bm, r) == 12
        assert r.block_table == first[i][:3]
        bm.free(r)


def test_can_allocate_counts_revived_cached_blocks(make_bm):
    bm = make_bm(num_blocks=3, block_size=4)
    a = req(range(9), "a")
    compute(bm, a, 9)
    bm.free(a)
    b = req(list(range(8)) + [50, 51, 52, 53, 54], "b")
    prefix = bm.lookup(b)
    assert prefix == [0, 1]
    assert not bm.can_allocate(b, 5, prefix)     # 2 revived + 2 fresh > 3
    assert bm.can_allocate(b, 4, prefix)         # 2 revived + 1 fresh
    assert not bm.can_allocate(b, 4, prefix, reserve=1)
    assert bm.allocate_prefix(b, prefix) == 8
    assert bm.allocate(b, 4) == [2]
    assert bm.num_free_blocks == 0
    with pytest.raises(MemoryError):
        bm.allocate(b, 5)


def test_integrity_check_catches_corruption(make_bm):
    bm = make_bm(num_blocks=4, block_size=4)
    a = req(range(8), "a")
    compute(bm, a, 8)
    inner = bm.bm
    with pytest.raises(IntegrityError):
        inner.check_integrity([])                # a holds blocks the caller forgot: a leak
    inner.blocks[0].ref_count += 1
    with pytest.raises(IntegrityError):
        inner.check_integrity([a.block_table])
    inner.blocks[0].ref_count -= 1
    inner.blocks[1].hash = b"stale"
    with pytest.raises(IntegrityError):
        inner.check_integrity([a.block_table])


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
