"""The fleet simulator's measuring mode on the default model: the steps it times have the
shapes the grid asks for, read from the scheduler's own plans, and the fit gives a cost file
the simulator loads. Times are not checked (a shared machine's are noise)."""
import pytest

from benchmarks.fleet.cost import CostModel, StepShape
from benchmarks.fleet.measure import measure_steps
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


def test_measured_steps_have_the_grid_shapes(tmp_path):
    from benchmarks.fleet.cost import fit

    grid = {"prefill": [16, 40], "batches": [2], "contexts": [24], "decode_steps": 2}
    samples, settings = measure_steps({"max_model_len": 256}, grid, threads=None, seed=0)
    shapes = [s for s, _ in samples]
    # single prompts: one step each, its whole prompt, one sampled sequence
    assert StepShape(16, 1, 0, 16 * 17 / 2) in shapes
    assert StepShape(40, 1, 0, 40 * 41 / 2) in shapes
    # two prompts of 24 in one step, then two decodes reading 25 and 26 tokens each
    assert StepShape(48, 2, 0, 2 * 24 * 25 / 2) in shapes
    assert StepShape(2, 2, 50, 0.0) in shapes and StepShape(2, 2, 52, 0.0) in shapes
    # a prompt joining 16 decodes: a mixed step
    assert any(s.seqs == 17 and s.kv > 0 and s.attn > 0 for s in shapes)
    assert all(t > 0 for _, t in samples)
    assert settings["num_blocks"] > 0 and settings["max_num_batched_tokens"] >= 40
    knots, c_seq, c_kv, c_attn = fit(samples)
    cost = CostModel(name="cpu", knots=knots, c_seq=c_seq, c_kv=c_kv, c_attn=c_attn,
                     num_blocks=settings["num_blocks"])
    cost.save(tmp_path / "cpu.json")
    assert CostModel.load(tmp_path / "cpu.json") == cost
    assert cost.step_time(StepShape(16, 1, 0, 136.0)) > 0


def test_served_run_reports_the_prefix_cache_hits():
    """`routers --measure` reads the hit rate from the requests' own metrics: requests that
    share a 64-token prefix, arriving apart, find it cached (all but the first, whole blocks
    of 16), and no more than that."""
    import math

    from benchmarks.fleet.sim import Workload
    from benchmarks.fleet.validate import served_run

    workload = Workload(num_requests=4, rate=2.0, input_len=(8, 8), output_len=(4, 4),
                        prefix_groups=1, prefix_len=64, seed=3)
    run = served_run(1, workload, "prefix_affinity", ["--max-model-len", "256"])
    assert run["requests"] == 4 and run["output_tokens"] == 16
    # the first request computes the prefix; each later one can reuse its 4 whole blocks
    assert 0 < run["prefix_hit_rate"] <= 3 * 64 / (4 * 72)
    assert math.isfinite(run["tok_per_s"])
