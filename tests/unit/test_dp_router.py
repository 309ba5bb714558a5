"""The frontend's data-parallel router, without processes: samples of a request and their
aborts go to one replica; the policies; a dead replica's sequences fail and new work avoids it;
stats are gathered from every live replica."""
from conveyor.frontend.router import MAX_IMBALANCE, Router
from conveyor.shared.messages.engine import (
    Abort,
    AddRequest,
    Stats,
    StatsRequest,
    TokenOutput,
    TokenOutputs,
)
from conveyor.shared.replicas import replica_of, scheduler_name, worker_name
from conveyor.shared.sampling_params import SamplingParams


def make(policy="prefix_affinity", n=2):
    sent = [[] for _ in range(n)]
    outputs, stats = [], []
    router = Router([s.append for s in sent], policy, 16, outputs.extend, stats.append)
    return router, sent, outputs, stats


def add(router, rid, tokens, samples=1):
    for i in range(samples):
        router.send(AddRequest(id=f"{rid}/{i}", token_ids=tokens, sampling=SamplingParams()))


def test_samples_and_aborts_of_a_request_go_to_its_replica():
    router, sent, _, _ = make("round_robin")
    add(router, "a", [1, 2, 3], samples=3)
    add(router, "b", [1, 2, 3], samples=2)
    assert [m.id for m in sent[0]] == ["a/0", "a/1", "a/2"]
    assert [m.id for m in sent[1]] == ["b/0", "b/1"]
    router.send(Abort(ids=["b/1", "a/0"]))
    assert sent[0][-1].ids == ["a/0"] and sent[1][-1].ids == ["b/1"]
    assert (router.load(0), router.load(1)) == (3, 2)
    router.on_message(0, TokenOutputs([TokenOutput(f"a/{i}", [], finish_reason="abort")
                                       for i in range(3)]))
    assert router.load(0) == 0 and "a" not in router.where


def test_a_prefix_sticks_to_a_replica_until_it_is_too_busy():
    router, sent, _, _ = make("prefix_affinity", n=4)
    prefix = list(range(100, 164))                   # four blocks of 16
    add(router, "p0", prefix + [1])
    home = next(r for r in range(4) if sent[r])
    for i in range(1, 6):                            # other tails, the same first four blocks
        add(router, f"p{i}", prefix + [i, i])
    assert len(sent[home]) == 6 and router.load(home) == 6
    others = {router.choose(AddRequest(id=f"q{i}/0", token_ids=list(range(i, i + 64)),
                                       sampling=SamplingParams())) for i in range(40)}
    assert len(others) > 1                           # other prefixes spread over the replicas
    for i in range(6, MAX_IMBALANCE + 1):
        add(router, f"p{i}", prefix + [i])
    assert router.load(home) == MAX_IMBALANCE + 1    # one beyond the others: the next moves
    add(router, "moved", prefix)
    assert router.where["moved"] != home


def test_short_prompts_and_least_loaded_go_to_the_least_loaded():
    for policy in ("least_loaded", "prefix_affinity"):
        router, sent, _, _ = make(policy)
        add(router, "a", [1, 2], samples=2)
        add(router, "b", [1, 2])
        add(router, "c", [1, 2])
        assert [len(s) for s in sent] == [2, 2], policy


def test_a_dead_replica_fails_its_sequences_and_gets_no_new_ones():
    router, sent, outputs, stats = make("round_robin")
    add(router, "a", [1], samples=2)
    add(router, "b", [1])
    router.send(StatsRequest())
    router.on_message(0, Stats(num_running=2, prefix_cache_hits=5))
    router.replica_dead(0, "replica 0 failed: scheduler-0 died")
    assert [(o.id, o.finish_reason, o.error_code) for o in outputs] == [
        ("a/0", "error", 503), ("a/1", "error", 503)]
    assert "scheduler-0 died" in outputs[0].error
    assert stats == []                               # still waiting for replica 1
    router.on_message(1, Stats(num_running=1, prefix_cache_hits=7))
    (total,) = stats
    assert (total.num_running, total.prefix_cache_hits, total.dead_replicas) == (1, 7, [0])
    assert [s.replica for s in total.replicas] == [1]
    for rid in ("c", "d", "e"):
        add(router, rid, [1])
    # a/0, a/1 and the StatsRequest; b/0, the StatsRequest, c, d and e
    assert (len(sent[0]), len(sent[1])) == (3, 5)
    router.send(Abort(ids=["a/0"]))                  # nothing is sent to the dead replica
    assert len(sent[0]) == 3


def test_replica_names_round_trip():
    for dp in (1, 3):
        for replica in range(dp):
            assert replica_of(scheduler_name(replica, dp)) == replica
            assert replica_of(worker_name(replica, 2, dp)) == replica
    assert replica_of("frontend-1") is None
    assert (scheduler_name(0, 1), worker_name(0, 1, 1)) == ("scheduler", "worker-1")
