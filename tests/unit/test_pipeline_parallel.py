"""Pipeline parallelism without processes: the layer split and rank layout, which checkpoint
tensors a stage loads, the refused combinations, and the scheduler's micro-batches on the fake
worker of tests/scheduler_util.py (which also checks that a stage that does not sample is told
every token it reads).
"""
from __future__ import annotations

import pytest
from scheduler_util import Harness, prompts, reference

from conveyor.shared.config import EngineConfig
from conveyor.shared.parallel import layer_split, rank_place, reporting_rank, stage_ranks


@pytest.mark.parametrize("layers, pp, sizes", [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (7, 4, [2, 2, 2, 1]), (30, 4, [7, 8, 8, 7]),
    (3, 3, [1, 1, 1]), (6, 1, [6]), (10, 3, [3, 4, 3])])
def test_layer_split_is_vllms(layers, pp, sizes):
    split = layer_split(layers, pp)
    assert [len(r) for r in split] == sizes
    assert split[0].start == 0 and split[-1].stop == layers
    assert all(a.stop == b.start for a, b in zip(split, split[1:]))


def test_a_stage_without_layers_is_refused():
    with pytest.raises(ValueError, match="between 1 and the model's 2 layers"):
        layer_split(2, 3)


def test_ranks_are_stage_major():
    # PP 2 x TP 2: ranks 0, 1 are stage 0; 2, 3 stage 1, whose rank 2 samples
    assert [rank_place(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert list(stage_ranks(1, 2)) == [2, 3]
    assert reporting_rank(2, 2) == 2 and reporting_rank(4, 1) == 0


def test_each_stage_loads_only_its_own_tensors():
    from conveyor.worker.layers.pipeline import Stage, set_stage, stage_weight_name

    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.2.self_attn.q_proj.weight", "model.layers.4.input_layernorm.weight",
             "model.norm.weight", "lm_head.weight"]
    try:
        set_stage(Stage(0, 2, -1, 1))                    # layers 0-2 of 5
        assert [stage_weight_name(n, 5, False) for n in names] == names[:3] + [None] * 3
        set_stage(Stage(1, 2, 0, -1))                    # layers 3-4, the head
        assert [stage_weight_name(n, 5, False) for n in names] == [None] * 3 + names[3:]
        # tied embeddings: the last stage loads the embedding as its head
        assert stage_weight_name(names[0], 5, True) == "lm_head.weight"
    finally:
        set_stage(Stage())
    assert [stage_weight_name(n, 5, True) for n in names] == names


@pytest.mark.parametrize("option, value", [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ("enable_lora", True), ("kv_cache_dtype", "fp8")])
def test_combinations_not_built_are_refused_naming_both(option, value):
    with pytest.raises(ValueError, match=f"{option} .* pipeline_parallel_size 2"):
        EngineConfig(pipeline_parallel_size=2, **{option: value})
    EngineConfig(pipeline_parallel_size=1, **{option: value})
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        EngineConfig(pipeline_parallel_size=0)


def pp_harness(pp: int, **kw) -> Harness:
    return Harness(depth=pp, pipeline_parallel_size=pp, **kw)


def in_flight_ids(h: Harness) -> list[set[str]]:
    return [{p.req.id for p in planned} for _, planned, _ in h.sched._in_flight]


@pytest.mark.parametrize("pp", [2, 4])
def test_micro_batches_give_the_same_tokens(pp):
    h = pp_harness(pp, budget=64, max_num_seqs=16, num_blocks=200)
    ps = prompts(12, 9, shared=4)
    for i, p in enumerate(ps):
        h.add(f"r{i}", p, max_tokens=10)
    out = h.run()
    assert all(out[f"r{i}"].tokens == reference(p, 10) for i, p in enumerate(ps))
    assert h.sched.max_in_flight == pp


def test_micro_batches_are_disjoint_and_even():
    h = pp_harness(2, budget=64, max_num_seqs=16, num_blocks=200)
    for i, p in enumerate(prompts(8, 6)):
        h.add(f"r{i}", p, max_tokens=12)
    sizes = []
    for _ in range(12):
        plan = h.plan()
        flights = in_flight_ids(h)
        if len(flights) == 2:
            assert not flights[0] & flights[1], "a request in two micro-batches at once"
            sizes.append([len(f) for f in flights])
        if plan is None or len(flights) == 2:
            h.apply()
    assert len(sizes) >= 5 and all(s == [4, 4] for s in sizes), sizes
    h.run()
    assert h.max_pending == 1


def test_requests_arriving_while_micro_batches_are_in_flight():
    h = pp_harness(2, budget=32, max_num_seqs=8, num_blocks=100)
    ps = prompts(7, 8)
    for i in range(3):
        h.add(f"r{i}", ps[i], max_tokens=9)
    added, steps = 3, 0
    while h.busy():
        steps += 1
        if added < len(ps) and steps % 2 and h.sched.num_in_flight == 1:
            h.add(f"r{added}", ps[added], max_tokens=9)      # one stage busy, one free
            added += 1
    assert added == len(ps)
    assert all(h.out[f"r{i}"].tokens == reference(p, 9) for i, p in enumerate(ps))
    assert h.sched.blocks.num_free_blocks == h.sched.blocks.num_blocks


def test_preemption_under_pipeline_parallel():
    ps = prompts(6, 11, shared=4)
    h = pp_harness(2, num_blocks=10, block_size=4, budget=24)
    for i, p in enumerate(ps):
        h.add(f"r{i}", p, max_tokens=20)
    out = h.run()
    assert h.sched.num_preemptions > 0
    resumed = [n for p in h.worker.plans for n in p.new if len(n.token_ids) > n.prompt_len]
    assert resumed
    assert all(out[f"r{i}"].tokens == reference(p, 20) for i, p in enumerate(ps))


def test_abort_with_micro_batches_in_flight():
    h = pp_harness(2, max_num_seqs=4, budget=16)
    for i, p in enumerate(prompts(4, 6)):
        h.add(f"r{i}", p, max_tokens=30)
    for _ in range(5):
        h.step()
    h.plan()                                       # a micro-batch in each stage
    assert h.sched.num_in_flight == 2
    flights = in_flight_ids(h)
    victims = [sorted(flights[0])[0], sorted(flights[1])[0]]
    h.collect(h.sched.abort(victims))
    h.sched.check_integrity()
    out = h.run()                                  # every block back, each request ends once
    for rid in victims:
        assert out[rid].finish_reason == "abort"
    kept = [f"r{i}" for i in range(4) if f"r{i}" not in victims]
    assert all(len(out[k].tokens) == 30 for k in kept)
