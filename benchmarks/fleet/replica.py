"""One engine replica on paper: its KV pool with a prefix cache, and its scheduler's plans.

`Lane` plans steps the way conveyor/scheduler/scheduler.py does, on sizes instead of tokens:
running requests first in the order they were admitted, each its whole remainder within the
token budget (a decode 1, the last admitted maybe the rest of its prompt); a running request
short of blocks preempts the latest arrival (fcfs) and is recomputed later; after a preemption
nothing is admitted. Then waiting requests by arrival, each after the longest cached prefix of
its prompt, while a sequence slot is free and the free blocks cover its expected length beyond
the running requests' expected growth (the mean output length seen: admission.py), at least the
watermark; a prompt that does not fit the budget is chunked and ends the step's admissions.
With overlap (async scheduling) a plan is made while the one before runs, as if it were done.
Not modelled: the fairness guard (max_wait_s), other policies than fcfs, EOS (a request makes
exactly its output length), speculative decoding, LoRA.

`KVPool` counts blocks like conveyor/scheduler/block_manager.py: free blocks without cached
content are handed out first, then cached ones least recently freed first (a finished request's
tail before its head); a block is findable while it is held or free and not yet handed out.
Blocks of a request's shared prompt prefix are named (group, index); other full blocks can never
be hit again, so a request's run of them is one entry of the LRU.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from conveyor.scheduler.admission import RunningMean
from conveyor.scheduler.scheduler import WATERMARK


@dataclass(slots=True, eq=False)
class Seq:
    """A request and its progress on its replica."""
    rid: int
    arrival: float
    prompt_len: int
    out_len: int
    group: int = -1                          # shared-prefix group (-1: none)
    shared_blocks: int = 0                   # full blocks of the group's prefix at its head
    frontend: int = 0
    replica: int = -1
    computed: int = 0                        # tokens planned (computed once their step ends)
    n_out: int = 0                           # tokens sampled and delivered
    pending: int = 0                         # sampling steps in flight
    incarnation: int = 0                     # preemptions so far
    blocks: int = 0                          # blocks held
    keys: list = field(default_factory=list)  # the shared-prefix blocks held, as cache keys
    registered: int = 0                      # full blocks offered to the cache
    running: bool = False
    cached_tokens: int = -1                  # prefix-cache hit at first admission
    first_token: float = -1.0
    finished: float = -1.0

    @property
    def known(self) -> int:
        return self.prompt_len + self.n_out

    @property
    def order(self) -> tuple[float, int]:
        return self.arrival, self.rid


@dataclass(slots=True)
class Part:
    """One request's share of a planned step: num tokens after start."""
    seq: Seq
    num: int
    start: int
    sample: bool
    incarnation: int


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.plain = num_blocks              # free blocks with nothing cached
        self.lru: OrderedDict = OrderedDict()   # free cached blocks, oldest first: key -> count
        self.lru_count = 0
        self.held: dict = {}                 # shared-prefix key -> refs of running requests
        self.queries = 0                     # prompt tokens looked up (as conveyor counts them)
        self.hits = 0                        # ... and found

    @property
    def num_free(self) -> int:
        return self.plain + self.lru_count

    def lookup(self, seq: Seq) -> int:
        """Blocks of the longest cached prefix of `seq` (never its last known token's)."""
        if not self.caching or seq.group < 0:
            return 0
        n = min(seq.shared_blocks, (seq.known - 1) // self.block_size)
        i, g = 0, seq.group
        while i < n and ((g, i) in self.held or (g, i) in self.lru):
            i += 1
        return i

    def needed(self, seq: Seq, num: int, hits: int) -> int:
        """Free blocks `seq` takes to cover num more tokens (after `hits` cached blocks if it
        holds none), as BlockManager.num_needed."""
        if not hits:
            return max(0, -(-(seq.computed + num) // self.block_size) - seq.blocks)
        revived = sum((seq.group, i) in self.lru for i in range(hits))
        return max(0, -(-(hits * self.block_size + num) // self.block_size) - hits) + revived

    def take_prefix(self, seq: Seq, hits: int) -> None:
        g = seq.group
        for i in range(hits):
            key = (g, i)
            if key in self.lru:
                del self.lru[key]
                self.lru_count -= 1
                self.held[key] = 1
            else:
                self.held[key] += 1
        seq.keys = [(g, i) for i in range(hits)]
        seq.blocks = seq.registered = hits
        seq.computed = hits * self.block_size
        if self.caching:
            self.queries += seq.known
            self.hits += seq.computed

    def grow(self, seq: Seq, end: int) -> None:
        """Give `seq` the blocks to cover tokens [0, end); the caller checked they are free."""
        n = -(-end // self.block_size) - seq.blocks
        if n <= 0:
            return
        seq.blocks += n
        take = min(n, self.plain)
        self.plain -= take
        n -= take
        self.lru_count -= n
        while n:                             # evict the least recently freed cached blocks
            key, count = self.lru.popitem(last=False)
            if count > n:
                self.lru[key] = count - n
                self.lru.move_to_end(key, last=False)
                n = 0
            else:
                n -= count

    def register(self, seq: Seq, end: int) -> None:
        """Its blocks full of computed tokens among [0, end) become findable (first writer
        wins: a block whose key is cached already stays a private copy)."""
        if not self.caching:
            return
        full = end // self.block_size
        if full <= seq.registered:
            return
        g = seq.group
        for i in range(seq.registered, min(full, seq.shared_blocks)):
            key = (g, i)
            if key not in self.held and key not in self.lru:
                self.held[key] = 1
                seq.keys.append(key)
        seq.registered = full

    def free(self, seq: Seq) -> None:
        private_cached = max(0, seq.registered - seq.shared_blocks) if self.caching else 0
        self.plain += seq.blocks - len(seq.keys) - private_cached
        if private_cached:                   # the tail first: freed earlier, evicted earlier
            self.lru[("p", seq.rid, seq.incarnation)] = private_cached
            self.lru_count += private_cached
        for key in reversed(seq.keys):
            refs = self.held[key] - 1
            if refs:
                self.held[key] = refs
            else:
                del self.held[key]
                self.lru[key] = 1
                self.lru_count += 1
        seq.keys = []
        seq.blocks = seq.registered = seq.computed = 0


class Lane:
    """A scheduler over one KV pool (a replica, or one of its pipeline's virtual engines)."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, token_budget: int,
                 async_scheduling: bool, caching: bool = True) -> None:
        self.pool = KVPool(num_blocks, block_size, caching)
        self.block_size = block_size
        self.max_num_seqs, self.budget = max_num_seqs, token_budget
        self.max_len = num_blocks * block_size
        self.max_in_flight = 2 if async_scheduling else 1
        self.watermark = int(WATERMARK * num_blocks)
        self.output_len = RunningMean()
        self.waiting: list[Seq] = []         # by arrival
        self.running: list[Seq] = []         # in admission order
        self.in_flight: deque[list[Part]] = deque()
        self.num_preemptions = 0
        self.sampled = 0                     # tokens sampled so far

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def can_plan(self) -> bool:
        return (bool(self.waiting or self.running)
                and len(self.in_flight) < self.max_in_flight)

    def add(self, seq: Seq) -> None:
        if seq.prompt_len + 1 > self.max_len:
            raise ValueError(f"request {seq.rid}: a {seq.prompt_len}-token prompt does not fit "
                             f"a pool of {self.max_len} tokens")
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def schedule(self) -> list[Part] | None:
        budget = self.budget
        batch: list[Part] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if not seq.running or self._ends_in_flight(seq):
                continue
            num = min(seq.known + seq.pending - seq.computed, budget)
            while self.pool.needed(seq, num, 0) > self.pool.num_free:
                planned = {id(p.seq) for p in batch}
                victim = max((r for r in self.running if id(r) not in planned),
                             key=lambda s: s.order)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.running:
                batch.append(self._plan(seq, num))
                budget -= num
        if not preempted or not batch:
            self._admit(batch, budget)
        if not batch:
            return None
        self.in_flight.append(batch)
        return batch

    def update(self, now: float) -> list[Seq]:
        """Apply the oldest plan's result at `now`; returns the requests it finished (those
        with a first token have first_token set)."""
        done = []
        for p in self.in_flight.popleft():
            seq = p.seq
            if seq.finished >= 0:
                continue
            if seq.running and seq.incarnation == p.incarnation:
                self.pool.register(seq, p.start + p.num)
            if not p.sample:
                continue
            seq.pending -= 1
            seq.n_out += 1
            self.sampled += 1
            if seq.n_out == 1:
                seq.first_token = now
            if seq.n_out >= seq.out_len or seq.known >= self.max_len:
                seq.finished = now
                if seq.running:
                    self.pool.free(seq)
                    seq.running = False
                self.output_len.add(seq.n_out)
                done.append(seq)
        if done:
            self.running = [s for s in self.running if s.finished < 0]
            self.waiting = [s for s in self.waiting if s.finished < 0]
        return done

    # --- planning ---------------------------------------------------------------------------

    def _ends_in_flight(self, seq: Seq) -> bool:
        return seq.pending > 0 and (seq.n_out + seq.pending >= seq.out_len
                                    or seq.known + seq.pending >= self.max_len)

    def _plan(self, seq: Seq, num: int) -> Part:
        start = seq.computed
        end = start + num
        sample = end == seq.known + seq.pending
        self.pool.grow(seq, end)
        seq.computed = end
        seq.pending += sample
        return Part(seq, num, start, sample, seq.incarnation)

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.free(seq)
        seq.running = False
        seq.incarnation += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def _admit(self, batch: list[Part], budget: int) -> None:
        growth: int | None = None
        admitted = 0
        for seq in self.waiting:
            if budget == 0 or seq.pending:
                break
            hits = self.pool.lookup(seq)
            start = hits * self.block_size
            num = min(seq.known - start, budget)
            fits, growth = self._fits(seq, num, hits, growth)
            if not fits:
                break
            self.pool.take_prefix(seq, hits)
            if seq.cached_tokens < 0:
                seq.cached_tokens = start
            seq.running = True
            self.running.append(seq)
            batch.append(self._plan(seq, num))
            budget -= num
            if growth is not None:
                growth += self._growth(seq)
            admitted += 1
            if num < seq.known - start:
                break
        if admitted:
            self.waiting = self.waiting[admitted:]

    def _fits(self, seq: Seq, num: int, hits: int, growth: int | None
              ) -> tuple[bool, int | None]:
        if len(self.running) >= self.max_num_seqs:
            return False, growth
        if not self.running:
            return self.pool.needed(seq, num, hits) <= self.pool.num_free, growth
        if growth is None:
            growth = sum(self._growth(r) for r in self.running)
        expected = max(num, self._expected_len(seq) - hits * self.block_size)
        needed = self.pool.needed(seq, expected, hits)
        return needed + max(self.watermark, growth) <= self.pool.num_free, growth

    def _expected_len(self, seq: Seq) -> int:
        output = min(round(self.output_len.value), seq.out_len)
        return max(seq.known + seq.pending, min(seq.prompt_len + output, self.max_len))

    def _growth(self, seq: Seq) -> int:
        return max(0, -(-self._expected_len(seq) // self.block_size) - seq.blocks)
