"""conveyor/worker/profiling.py: the step window, a window cut short, and bad settings."""
import pytest
import torch

from conveyor.worker.profiling import StepProfiler


def test_off_unless_a_folder_is_given(monkeypatch):
    monkeypatch.delenv("CONVEYOR_PROFILE_DIR", raising=False)
    assert StepProfiler.from_env(0, cuda=False) is None


@pytest.mark.parametrize("steps", ["3", "a:b", "1:0", "-1:2"])
def test_a_bad_window_is_refused(monkeypatch, tmp_path, steps):
    monkeypatch.setenv("CONVEYOR_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_PROFILE_STEPS", steps)
    with pytest.raises(ValueError, match="CONVEYOR_PROFILE_STEPS"):
        StepProfiler.from_env(0, cuda=False)


def test_the_window_covers_its_steps_only(tmp_path):
    prof = StepProfiler(str(tmp_path), 1, start=2, count=2, cuda=False)
    marks = []
    for step in range(6):
        prof.before_step()
        torch.ones(8).add_(step)          # one op per step, inside the window or not
        marks.append((tmp_path / "worker-1.txt").exists())
    assert marks == [False, False, False, False, True, True]
    assert (tmp_path / "worker-1.txt").read_text().startswith("worker 1: steps 2 to 3 (2 steps)")


def test_shutdown_writes_a_window_cut_short(tmp_path):
    prof = StepProfiler(str(tmp_path), 0, start=0, count=100, cuda=False)
    prof.before_step()
    prof.before_step()
    prof.finish()
    prof.finish()                         # nothing left open: a no-op
    assert (tmp_path / "worker-0.txt").read_text().startswith("worker 0: steps 0 to 1 (2 steps)")
    assert (tmp_path / "worker-0.json").exists()


def test_the_offline_engine_profiles_as_worker_0(tmp_path, monkeypatch):
    from models_util import make_tiny_model

    from conveyor import LLM, SamplingParams

    monkeypatch.setenv("CONVEYOR_PROFILE_DIR", str(tmp_path / "profile"))
    monkeypatch.setenv("CONVEYOR_PROFILE_STEPS", "1:2")
    llm = LLM(model=str(make_tiny_model("llama", tmp_path / "llama")), skip_tokenizer_init=True,
              kv_cache_memory_bytes=16 << 20)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    table = (tmp_path / "profile" / "worker-0.txt").read_text()
    assert table.startswith("worker 0: steps 1 to 2 (2 steps)") and "aten::" in table
    trace = (tmp_path / "profile" / "worker-0.json").read_text()
    for phase in ("conveyor: plan", "conveyor: run a step", "conveyor: apply a result"):
        assert f'"name": "{phase}"' in trace, phase          # host phases on the CPU timeline


def test_host_phases_are_recorded_only_inside_the_window(tmp_path):
    from conveyor.worker.profiling import host_phase

    prof = StepProfiler(str(tmp_path), 0, start=1, count=1, cuda=False)
    for step in range(3):
        prof.before_step()
        with host_phase(prof, f"conveyor: phase {step}"):
            torch.ones(4).add_(step)
    with host_phase(None, "conveyor: no profiler"):   # no profiler at all: nothing to do
        pass
    trace = (tmp_path / "worker-0.json").read_text()
    assert '"conveyor: phase 0"' not in trace and '"conveyor: phase 2"' not in trace
    assert '"conveyor: phase 1"' in trace
