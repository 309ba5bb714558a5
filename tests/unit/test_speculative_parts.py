"""Speculative decoding's parts without a model: the config, n-gram lookup, verification
(rejection sampling) against the exact distributions, and the scheduler's budgeting and
rollback of rejected guesses."""
import numpy as np
import pytest
import torch

from conveyor.scheduler.scheduler import Scheduler
from conveyor.scheduler.speculation import MAX_SPEC_WAIT, SPEC_COST, SPEC_GAIN_EMA
from conveyor.shared.config import EngineConfig
from conveyor.shared.messages.engine import AddRequest
from conveyor.shared.messages.worker import StepResult
from conveyor.shared.sampling_params import SamplingParams
from conveyor.shared.speculative import SpeculativeConfig
from conveyor.worker.sampler import Sampler, SeqSamplingState
from conveyor.worker.spec.ngram import NgramIndex, NgramProposer
from conveyor.worker.spec.verify import accepted_runs, verify

# --- configuration -------------------------------------------------------------------------

def test_config_from_json_and_dict():
    c = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4, '
                                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert c.speculative == SpeculativeConfig("ngram", 4, 2, 5)
    assert c.replace(seed=3).speculative == c.speculative
    d = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                         "prompt_lookup_max": 3})
    assert (d.speculative.prompt_lookup_min, d.speculative.prompt_lookup_max) == (3, 3)
    assert EngineConfig().speculative is None
    e = EngineConfig(speculative_config={"method": "draft_model", "draft_num_layers": 4,
                                         "num_speculative_tokens": 3})
    assert (e.speculative.model, e.speculative.draft_num_layers) == (None, 4)


@pytest.mark.parametrize("value, key", [
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "lookahead"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ('{"method": "draft_model", "model": "", "num_speculative_tokens": 2}', "model"),
    ('{"method": "draft_model", "draft_num_layers": 0, "num_speculative_tokens": 2}',
     "draft_num_layers"),
    ('{"method": "ngram", "draft_num_layers": 2, "num_speculative_tokens": 2}',
     "draft_num_layers"),
    ('{"method": "draft_model", "draft_num_layers": 2, "num_speculative_tokens": 2, '
     '"prompt_lookup_min": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}',
     "disable_by_batch_size"),
    ('{"method": ', "JSON"),
    ('[1, 2]', "JSON object"),
])
def test_bad_config_names_the_key(value, key):
    with pytest.raises(ValueError, match=key):
        EngineConfig(speculative_config=value)


def test_cli_flag():
    from conveyor.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(
        ["generate", "x", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineConfig(**engine_kwargs(args)).speculative.num_speculative_tokens == 3


# --- n-gram lookup -------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, k, lo, hi, expected", [
    ([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 4, 2, 5, [4, 5, 9, 9]),
    ([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 4, 4, 5, []),            # the suffix recurs only 3 long
    ([1, 2, 1, 2, 8, 1, 2], 2, 1, 3, [8, 1]),                 # the latest occurrence
    ([5, 1, 2, 3, 6, 2, 3, 7, 1, 2, 3], 3, 1, 3, [6, 2, 3]),  # the longest suffix wins
    ([7, 7, 7, 7], 3, 1, 3, [7]),                             # as far as the sequence goes
    ([4], 3, 1, 3, []),
    ([1, 2, 3], 3, 1, 3, []),
])
def test_ngram_guess(tokens, k, lo, hi, expected):
    assert NgramIndex(lo, hi).guess(tokens, k) == expected
    assert reference_guess(np.array(tokens), k, lo, hi) == expected


def reference_guess(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The rule from scratch: every earlier end of the last token, the length of the suffix
    matched backwards from it (at most max_n), the longest then latest."""
    n = len(tokens)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) if n > min_n else np.array([], int)
    if not ends.size:
        return []
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for d in range(1, min(max_n, n - 1)):
        before = ends - d
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[n - 1 - d]
        length += alive
    best = int(np.argmax(length * n + ends))
    if length[best] < min_n:
        return []
    return tokens[ends[best] + 1:ends[best] + 1 + k].tolist()


@pytest.mark.parametrize("lo, hi, k", [(1, 1, 3), (2, 5, 4), (1, 3, 16), (3, 3, 2)])
def test_ngram_index_keeps_up_with_a_growing_sequence(lo, hi, k):
    """Looked up after every appended token (and at times after several), the index's guesses
    are the rule's from scratch; a proposer keeps an index a slot while its sequence stays."""
    rng = np.random.default_rng(lo * 10 + hi)
    tokens = rng.integers(0, 6, 40).tolist()          # a small vocabulary: many repeats
    index = NgramIndex(lo, hi)
    for end in range(1, len(tokens) + 1):
        if end % 7 == 3:
            continue                                  # some lookups skipped: several appended
        got = index.guess(tokens[:end], k)
        assert got == reference_guess(np.array(tokens[:end]), k, lo, hi), end
    proposer = NgramProposer(k, lo, hi)
    a = SeqSamplingState.new(SamplingParams(), tokens[:20], 20, "cpu")
    b = SeqSamplingState.new(SamplingParams(), tokens[20:], 20, "cpu")
    for state in (a, b, a):                           # a new sequence in the slot: a new index
        assert proposer.propose([0], [state]) == [
            reference_guess(np.array(state.token_ids), k, lo, hi)]


# --- verification --------------------------------------------------------------------------

V = 6
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5],
                       [0.0, 2.5, 1.0, 1.0, 0.3, -2.0],
                       [1.0, 1.0, 1.0, 0.0, 0.5, 2.0]])
GUESS = [5, 1]


def target(rows: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from, worked out by hand: temperature, top-k."""
    z = rows / p.temperature
    if p.top_k:
        kth = z.topk(p.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    return z.softmax(-1)


# structured outputs' masks of LOGITS' three rows: bit t allows token t
ALLOWED = [0b111101, 0b101111, 0b011111]


def run_verify(params, n, draft_probs=None, seed=0, masked=False):
    """n sequences, each with GUESS, or with guesses drawn from draft_probs (then per row its
    q), verified against LOGITS (a model that ignores the context); `masked`: every row
    constrained by its ALLOWED mask."""
    sampler = Sampler(V, (), seed, "cpu")
    states = [SeqSamplingState.new(params, [1, 2, 3], 3, "cpu") for _ in range(n)]
    logits = LOGITS.repeat(n, 1)
    guesses = torch.tensor([GUESS] * n)
    q = None
    if draft_probs is not None:
        g = torch.Generator().manual_seed(seed + 1)
        guesses = torch.stack([torch.multinomial(draft_probs[i], n, True, generator=g)
                               for i in range(2)], 1)
        q = draft_probs.repeat(n, 1)
    allowed = None
    if masked:
        allowed = (torch.tensor(ALLOWED * n, dtype=torch.int32)[:, None],
                   torch.arange(3 * n))
    v = verify(sampler, logits, states, guesses.tolist(), q, allowed)
    accepted = torch.tensor(accepted_runs(v.token_ids.tolist(), guesses.tolist()))
    return v.token_ids.view(n, 3), accepted, guesses


def check_frequencies(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    from scipy.stats import chisquare

    counts = torch.bincount(tokens, minlength=V).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, counts
    expected = probs[keep].double() / probs[keep].double().sum() * counts.sum()
    assert chisquare(counts[keep], expected).pvalue > 1e-3, (counts, expected)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4)])
@pytest.mark.parametrize("point_mass", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_verified_tokens_have_the_target_distribution(params, point_mass, masked):
    """Each output token, given the ones before it, is distributed as the target's row (with
    structured outputs' masks: the masked row; a draft's guesses are then at times tokens the
    mask refuses)."""
    n = 20000
    q = None
    if not point_mass:              # guesses drawn from a distribution unlike the target's
        q = torch.tensor([[0.1, 0.1, 0.1, 0.2, 0.2, 0.3], [0.3, 0.2, 0.2, 0.1, 0.1, 0.1],
                          [0.0] * V])
    tokens, accepted, guesses = run_verify(params, n, q, masked=masked)
    logits = LOGITS
    if masked:
        bits = torch.tensor([[(m >> t) & 1 for t in range(V)] for m in ALLOWED], dtype=torch.bool)
        logits = LOGITS.masked_fill(~bits, float("-inf"))
    p = target(logits, params)
    first = torch.where(accepted >= 1, guesses[:, 0], tokens[:, 0])
    check_frequencies(first, p[0])
    after_one = accepted >= 1
    second = torch.where(accepted[after_one] >= 2, guesses[after_one, 1], tokens[after_one, 1])
    check_frequencies(second, p[1])
    check_frequencies(tokens[accepted == 2, 2], p[2])
    assert 0 < (accepted == 0).sum() and 0 < (accepted == 2).sum()


def test_greedy_accepts_the_agreeing_run():
    tokens, accepted, _ = run_verify(SamplingParams(temperature=0), 1)
    assert accepted.tolist() == [0] and tokens[0, 0].item() == 0   # row 0's argmax is 0, not 5
    sampler = Sampler(V, (), 0, "cpu")
    state = SeqSamplingState.new(SamplingParams(temperature=0), [1, 2, 3], 3, "cpu")
    v = verify(sampler, LOGITS, [state], [[0, 1]])                 # rows' argmaxes: 0, 1, 5
    assert v.token_ids.tolist() == [0, 1, 5] and accepted_runs([0, 1, 5], [[0, 1]]) == [2]
    # a run stops at the first row whose token is not its guess; rows after it do not count
    assert accepted_runs([0, 7, 5, 4, 2, 3], [[0, 1], [4, 3]]) == [1, 1]


def test_penalties_count_the_guesses_before_a_row():
    """A frequency penalty: at row 1 the guess of row 0 counts as output, so the argmax
    moves off it."""
    params = SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=1)
    sampler = Sampler(V, (), 0, "cpu")
    state = SeqSamplingState.new(params, [1, 2, 3], 3, "cpu")
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.5, 1.0]])
    v = verify(sampler, logits, [state], [[4]])
    assert v.token_ids.tolist() == [4, 5]
    # logprobs are of the raw logits, for the chosen tokens
    assert torch.allclose(v.logprobs.values[:, 0], logits.log_softmax(-1)[[0, 1], [4, 5]])


# --- scheduler: budget and rollback ----------------------------------------------------------

def make_scheduler(k: int = 4, **spec) -> Scheduler:
    config = EngineConfig(block_size=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, **spec}, max_num_batched_tokens=64)
    return Scheduler(config, 32, (2,), 64)


DRAFT = {"method": "draft_model", "draft_num_layers": 1}


def add(s: Scheduler, rid: str, n: int = 6, **params) -> None:
    s.add(AddRequest(id=rid, token_ids=list(range(10, 10 + n)),
                     sampling=SamplingParams(temperature=0, **params)))


def test_rollback_trims_blocks_and_caches_only_accepted_tokens():
    s = make_scheduler()
    add(s, "a", max_tokens=20)
    plan = s.schedule()
    assert plan.propose and s.can_schedule()     # n-gram lookups overlap the next plan
    s.update(StepResult(plan.step, [7], [None], [], proposals=[[8, 9, 10, 11]]))
    plan = s.schedule()
    [seq] = plan.seqs
    assert seq.draft_token_ids == [8, 9, 10, 11] and seq.num_tokens == 5 and seq.sample
    req = s.requests["a"]
    assert len(req.block_table) == 3                          # 7 + 4 tokens of KV
    # one guess accepted (8), then 5 drawn: tokens prompt + [7, 8, 5], KV of 8 of them
    s.update(StepResult(plan.step, [8, 5], [None, None], [], num_sampled=[2],
                        proposals=[[6, 6]]))
    assert req.token_ids[6:] == [7, 8, 5] and req.num_computed_tokens == 8
    assert len(req.block_table) == 2 and req.num_cached_blocks == 2
    assert req.spec_token_ids == [6, 6]
    stats = s.stats()
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (4, 1)
    assert req.stats.num_draft_tokens == 4 and req.stats.num_accepted_tokens == 1
    s.check_integrity()


def test_guesses_fit_max_tokens_and_a_stop_inside_the_run_ends_it():
    s = make_scheduler()
    add(s, "a", max_tokens=4)
    plan = s.schedule()
    s.update(StepResult(plan.step, [7], [None], [], proposals=[[8, 2, 9, 9]]))
    plan = s.schedule()
    assert plan.seqs[0].draft_token_ids == [8, 2]             # 1 output so far, 4 at most
    out = s.update(StepResult(plan.step, [8, 2, 9], [None] * 3, [], num_sampled=[3]))
    assert out[0].new_token_ids == [8, 2] and out[0].finish_reason == "stop"
    assert s.blocks.num_free_blocks == 32 and not s.has_work()
    s.check_integrity()


def test_no_guesses_past_the_budget_or_the_batch_size_cutoff():
    s = make_scheduler(disable_by_batch_size=2)
    for rid in "ab":
        add(s, rid, max_tokens=20)
    plan = s.schedule()
    assert not plan.propose and s.can_schedule()               # 2 running: overlapped steps
    s.update(StepResult(plan.step, [7, 7], [None] * 2, []))
    s.abort(["b"])
    assert s.can_schedule()
    plan = s.schedule()                                        # 1 running: speculates again
    assert plan.propose and not plan.seqs[0].draft_token_ids
    s.update(StepResult(plan.step, [7], [None], [], proposals=[[1] * 4]))
    s.config = s.config.replace(max_num_batched_tokens=3)
    plan = s.schedule()
    assert plan.seqs[0].draft_token_ids == [1, 1]              # 3 tokens: 1 + 2 guesses
    s.update(StepResult(plan.step, [3], [None], [], num_sampled=[1]))
    s.check_integrity()


def test_ngram_guesses_follow_the_token_in_flight():
    """A plan that asks for n-gram guesses overlaps the next: its result's guesses (of the
    tokens after its own) are verified without their first, which guesses the token the plan
    in flight draws; the verifying plan runs alone, and the guesses of a result whose next
    plan verifies are dropped."""
    s = make_scheduler()
    add(s, "a", max_tokens=5)
    req = s.requests["a"]
    first = s.schedule()
    second = s.schedule()
    assert first.propose and second.propose and not s.can_schedule()   # two in flight
    s.update(StepResult(first.step, [7], [None], [], proposals=[[8, 9, 10, 11]]))
    assert req.spec_token_ids == [9, 10, 11]
    third = s.schedule()
    [seq] = third.seqs
    # max_tokens counts the token in flight: 5 - 1 drawn - 1 in flight leaves 2 guesses
    assert seq.draft_token_ids == [9, 10] and seq.num_tokens == 3 and seq.sample
    s.update(StepResult(second.step, [8], [None], [], proposals=[[9, 10, 11, 12]]))
    assert req.spec_token_ids == [] and not s.can_schedule()          # the third runs alone
    # one guess accepted (9), then 5 drawn; KV of all but the last
    s.update(StepResult(third.step, [9, 5], [None] * 2, [], num_sampled=[2],
                        proposals=[[6, 6]]))
    assert req.token_ids[6:] == [7, 8, 9, 5] and req.num_computed_tokens == 9
    assert req.spec_token_ids == [6, 6] and len(req.block_table) == 3
    s.check_integrity()
    last = s.schedule()                          # one token left: nothing to verify
    assert not last.seqs[0].draft_token_ids
    out = s.update(StepResult(last.step, [4], [None], [], proposals=[[]]))
    assert out[0].finish_reason == "length" and s.blocks.num_free_blocks == 32
    s.check_integrity()


def test_ngram_guesses_are_verified_while_they_pay():
    """Lookups cost nothing (they overlap), so only verifications move a request's average of
    accepted guesses: below SPEC_COST it sits out 2, 4, ... plans, its guesses dropped and its
    plans overlapping, and then its guesses are verified again while the average pays, or once
    MAX_SPEC_WAIT plans passed without a verification."""
    s = make_scheduler()
    add(s, "a", max_tokens=80)
    req = s.requests["a"]
    assert (SPEC_COST, SPEC_GAIN_EMA, MAX_SPEC_WAIT, req.spec_gain) == (1.0, 0.5, 8, 2.0)

    def step(found, sampled=(7,)):
        """Plan and apply one step alone; the guesses it verified."""
        plan = s.schedule()
        guesses = plan.seqs[0].draft_token_ids
        assert plan.propose and s.can_schedule() == (not guesses)
        s.update(StepResult(plan.step, list(sampled), [None] * len(sampled), [],
                            num_sampled=[len(sampled)] if guesses else None,
                            proposals=[found]))
        return guesses

    for _ in range(3):
        assert step([]) == []                   # empty lookups leave the average alone
    assert (req.spec_gain, req.spec_wait) == (2.0, 0)
    step([5, 5])
    assert step([5, 5]) == [5, 5]               # none accepted: 1.0, still verifying
    assert req.spec_gain == 1.0 and req.spec_token_ids == [5, 5]
    assert step([5, 5]) == [5, 5]               # 0.5: sits out 2 plans, guesses dropped
    assert (req.spec_misses, req.spec_wait, req.spec_token_ids) == (1, 2, [])
    for _ in range(MAX_SPEC_WAIT - 1):          # due after 2, but 0.5 does not pay
        assert step([5, 5]) == []
    assert step([5, 5]) == []
    assert step([5, 5, 5]) == [5, 5]            # 8 plans without: tried again
    assert (req.spec_misses, req.spec_wait) == (2, 4)
    for _ in range(MAX_SPEC_WAIT):
        step([5, 5, 5, 5])
    assert step([], sampled=(5, 5, 5, 9)) == [5, 5, 5, 5]    # tried again: three accepted
    # 0.25 + 0.5 (3 - 0.25): paying again
    assert (req.spec_misses, req.spec_wait, req.spec_gain) == (0, 0, 1.625)
    s.check_integrity()


def test_ngram_guesses_of_a_batch_are_verified_where_they_pay_for_it():
    """Four requests: one with guesses at hand and an average of 3.0 is below SPEC_COST for
    four, so the plan verifies nothing and overlaps; with two such (6.0) it verifies both.
    A request without guesses adds nothing, whatever its average."""
    s = make_scheduler()
    for name in "abcd":
        add(s, name, max_tokens=40)
    plan = s.schedule()
    s.update(StepResult(plan.step, [7] * 4, [None] * 4, [], proposals=[[]] * 4))
    reqs = [s.requests[name] for name in "abcd"]
    for req, gain, guesses in zip(reqs, (3.0, 0.0, 9.0, 9.0), ([5, 5], [5, 5], [], [])):
        req.spec_gain, req.spec_token_ids = gain, guesses
    plan = s.schedule()
    assert not any(q.draft_token_ids for q in plan.seqs) and s.can_schedule()
    s.update(StepResult(plan.step, [7] * 4, [None] * 4, [], proposals=[[]] * 4))
    for req, gain in zip(reqs, (3.0, 3.0)):
        req.spec_gain, req.spec_token_ids = gain, [5, 5]
    plan = s.schedule()
    assert [len(q.draft_token_ids) for q in plan.seqs] == [0, 0, 2, 2]   # decodes first
    assert not s.can_schedule()
    s.check_integrity()


def test_draft_model_requests_whose_guesses_do_not_pay_back_off_so_steps_overlap():
    """A plan asks for guesses while the requests due to look add up to SPEC_COST accepted
    guesses per asking plan for each running request (a moving average, hopeful at first);
    a request below that also sits out 2, 4, ... plans, and plans that ask for nothing
    overlap, until MAX_SPEC_WAIT plans passed without asking. Guesses a lookup finds are
    verified, and their acceptance moves the average; after a long accepted run an empty
    lookup does not stop the asking. (A draft model's rules: its guesses are its own steps
    right after the target's, so a plan that asks runs alone.)"""
    s = make_scheduler(**DRAFT)
    add(s, "a", max_tokens=80)
    req = s.requests["a"]
    assert (SPEC_COST, SPEC_GAIN_EMA, MAX_SPEC_WAIT, req.spec_gain) == (1.0, 0.5, 8, 2.0)

    def done(plan, proposals=None, sampled=(7,)):
        s.update(StepResult(plan.step, list(sampled), [None] * len(sampled), [],
                            num_sampled=[len(sampled)] if plan.seqs[0].draft_token_ids else None,
                            proposals=proposals if plan.propose else []))

    def ask(proposals, sampled=(7,)):
        plan = s.schedule()
        assert plan.propose and not s.can_schedule()
        done(plan, proposals, sampled)
        return plan

    def sit_out(n):
        """The next n plans ask for nothing, two in flight at a time."""
        flight = []
        for i in range(n):
            flight.append(s.schedule())
            assert not flight[-1].propose and not flight[-1].seqs[0].draft_token_ids
            assert s.can_schedule() == (i < n - 1 and len(flight) < 2)
            if not s.can_schedule():
                for plan in flight:
                    done(plan)
                flight = []

    ask([[]])                                   # nothing found: the average falls to 1.0
    assert (req.spec_gain, req.spec_wait) == (1.0, 0)
    ask([[]])                                   # 0.5: below SPEC_COST, sit out 2 plans
    assert (req.spec_gain, req.spec_misses, req.spec_wait) == (0.5, 1, 2)
    sit_out(MAX_SPEC_WAIT)                      # due again after 2, but 0.5 does not pay
    ask([[]])                                   # so it looks again after 8: 0.25, 4 plans
    assert (req.spec_misses, req.spec_wait) == (2, 4)
    sit_out(MAX_SPEC_WAIT)
    ask([[5, 5, 5, 5]])                         # found: verified next, the average waits for it
    assert (req.spec_gain, req.spec_wait) == (0.25, 0)
    plan = s.schedule()                         # alone, without asking (0.25 does not pay)
    assert plan.seqs[0].draft_token_ids == [5, 5, 5, 5] and not plan.propose
    assert not s.can_schedule()
    done(plan, sampled=(5, 5, 5, 5, 9))         # all four accepted: 2.125
    assert (req.spec_gain, req.spec_misses, req.spec_wait) == (2.125, 0, 0)
    ask([[]])                                   # an empty lookup: 1.0625, still asking
    ask([[6, 6]])
    plan = ask([[]], sampled=(9,))              # both refused: 0.53, a miss, guesses dropped
    assert plan.seqs[0].draft_token_ids == [6, 6]
    assert (req.spec_misses, req.spec_wait) == (1, 2) and req.spec_token_ids == []
    assert not s.schedule().seqs[0].draft_token_ids
    s.check_integrity()


def test_a_draft_model_plan_asks_for_a_batch_only_where_the_requests_due_pay_for_it():
    """Four requests, one of them accepting guesses well: its average alone (3.0) is below
    SPEC_COST for four, so plans overlap; with two such requests (6.0) the next plan asks."""
    s = make_scheduler(**DRAFT)
    for name in "abcd":
        add(s, name, max_tokens=40)
    plan = s.schedule()                          # the prefills: hopeful averages ask
    assert plan.propose
    done_all = StepResult(plan.step, [7] * 4, [None] * 4, [], proposals=[[]] * 4)
    s.update(done_all)
    gains = {"a": 3.0, "b": 0.0, "c": 0.0, "d": 0.0}
    for name, gain in gains.items():
        s.requests[name].spec_gain, s.requests[name].spec_wait = gain, 0
    assert not s.schedule().propose
    assert s.can_schedule()                      # a second plan overlaps the first
    s.requests["b"].spec_gain = 3.0
    assert not s.can_schedule()                  # the next asks: it waits to run alone


# --- metrics -------------------------------------------------------------------------------

def test_metrics_and_the_stats_line():
    from prometheus_client.parser import text_string_to_metric_families

    from conveyor.frontend.metrics import ServerMetrics
    from conveyor.scheduler.spec_counts import spec_line
    from conveyor.shared.messages.engine import Stats

    stats = Stats(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=30,
                  spec_propose_s=0.002, spec_verify_steps=8, spec_verify_s=0.4)
    body = ServerMetrics().render(stats)[0].decode()
    got = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
    assert got["conveyor:spec_decode_num_drafts_total"] == 10
    assert got["conveyor:spec_decode_num_draft_tokens_total"] == 40
    assert got["conveyor:spec_decode_num_accepted_tokens_total"] == 30
    assert got["conveyor:spec_decode_acceptance_ratio"] == 0.75
    assert got["conveyor:spec_decode_mean_accepted_length"] == 4.0
    assert got["conveyor:spec_decode_verify_seconds_total"] == 0.4
    line = spec_line(stats, Stats())
    assert line == (", speculative: acceptance 75.0 %, mean accepted length 4.00, propose "
                    "0.25 ms/step, verify 50.00 ms/step")
    assert spec_line(stats, stats) == ""
