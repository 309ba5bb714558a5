"""The reference workload and its salted copies: a salted pass keeps every prompt's length and
shares no prefix-cache block with the seed-0 prompts or another salt; bench_throughput's warm-up
never runs a timed prompt."""
from benchmarks.reference_workload import salted, workload
from benchmarks.throughput import warm_up

BLOCK = 16


def blocks(prompts) -> set[tuple[int, ...]]:
    """The first full block of each prompt (a prefix-cache hit needs the first block to match)."""
    return {tuple(p[:BLOCK]) for p in prompts}


def test_the_workload_is_the_seed_0_draw():
    prompts, max_tokens = workload()
    assert len(prompts) == len(max_tokens) == 256
    assert sum(map(len, prompts)) == 142_827 and sum(max_tokens) == 133_966   # ../shared GPU.md
    assert all(100 <= len(p) <= 1024 and 100 <= n <= 1024 for p, n in zip(prompts, max_tokens))
    assert workload(8)[0] == workload(8)[0]


def test_salting_keeps_lengths_and_changes_contents():
    prompts, _ = workload(64)
    a, b = salted(prompts, "a"), salted(prompts, "b")
    assert [len(p) for p in a] == [len(p) for p in b] == [len(p) for p in prompts]
    assert all(0 <= t <= 10000 for p in a for t in p)
    assert not blocks(a) & blocks(prompts) and not blocks(a) & blocks(b)
    assert salted(prompts, "a") == a                       # deterministic


def test_bench_throughput_warm_up_runs_no_timed_prompt():
    prompts, _ = workload()
    calls = warm_up(prompts)
    warm = [p for call in calls for p in call]
    assert not blocks(warm) & blocks(prompts)
    assert [len(p) for p in calls[-1]] == [len(p) for p in prompts[:32]]
