"""Where a worker rank sits when tensor and pipeline parallelism compose, and which layers each
pipeline stage holds. Torch-free: the launcher and the scheduler read it too.

A replica's world is PP x TP ranks, numbered stage-major: rank = stage * TP + tp_rank, so the
ranks of one stage (one tensor-parallel group) are neighbours, and the last stage's first rank,
which samples, reports every StepResult.
"""
from __future__ import annotations


def world_size(tp: int, pp: int) -> int:
    return tp * pp


def rank_place(rank: int, tp: int) -> tuple[int, int]:
    """rank -> (pipeline stage, rank within the stage's tensor-parallel group)."""
    return divmod(rank, tp)


def stage_ranks(stage: int, tp: int) -> range:
    """The global ranks of a stage's tensor-parallel group."""
    return range(stage * tp, (stage + 1) * tp)


def reporting_rank(tp: int, pp: int) -> int:
    """The rank that samples and sends StepResults: the last stage's first rank."""
    return (pp - 1) * tp


def layer_split(num_layers: int, pp: int) -> list[range]:
    """The decoder layers of each stage, vLLM's even split: num_layers // pp each, and the
    remainder one more each to the stages before the last, from the second-to-last backwards
    (the last stage also runs the final norm, the LM head and sampling). 5 layers over 2 stages:
    [0, 3), [3, 5); 7 over 4: 2, 2, 2, 1."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size must be between 1 and the model's "
                         f"{num_layers} layers, got {pp}")
    sizes = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        sizes[-2 - i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]
