"""A torch.profiler capture of a window of a worker's steps, for looking inside a served engine
(tensor parallel included, where scripts/gpu_idle.py's in-process engine cannot go).

    CONVEYOR_PROFILE_DIR=DIR [CONVEYOR_PROFILE_STEPS=START:COUNT] conveyor serve ...

Each worker (the in-process engine of LLM and the CLI counts as worker 0) profiles the steps
START .. START + COUNT - 1 it runs (default 100:20; a step is one StepPlan) and writes
DIR/worker-RANK.json, a Chrome trace (chrome://tracing, Perfetto), and DIR/worker-RANK.txt, its
ops and kernels by total time, when the window ends; under `serve` a window cut short by
shutdown is written then. Off (no cost) unless CONVEYOR_PROFILE_DIR is set.

Host phases of the step loop (`host_phase`: waiting for a plan, planning, running a step,
sending a result) are named ranges on the trace's CPU timeline, so a gap between kernels can be
matched with what the host was doing.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

# NOTE: torch is imported where it is used: conveyor.engine imports host_phase, and the
# scheduler process imports conveyor.engine without torch


class StepProfiler:
    def __init__(self, out_dir: str, rank: int, start: int, count: int, cuda: bool):
        if start < 0 or count < 1:
            raise ValueError(f"CONVEYOR_PROFILE_STEPS must be START:COUNT with START >= 0 and "
                             f"COUNT >= 1, got {start}:{count}")
        self.out = Path(out_dir)
        self.rank, self.start, self.count, self.cuda = rank, start, count, cuda
        self.steps = 0
        self.prof = None                  # torch.profiler.profile while the window is open

    @classmethod
    def from_env(cls, rank: int, cuda: bool) -> StepProfiler | None:
        """The profiler the environment asks for, or None; a bad window raises ValueError
        (called before the model loads, so that it fails fast)."""
        out_dir = os.environ.get("CONVEYOR_PROFILE_DIR")
        if not out_dir:
            return None
        window = os.environ.get("CONVEYOR_PROFILE_STEPS", "100:20")
        try:
            start, count = (int(v) for v in window.split(":"))
        except ValueError:
            raise ValueError(f"CONVEYOR_PROFILE_STEPS must be START:COUNT, "
                             f"got {window!r}") from None
        return cls(out_dir, rank, start, count, cuda)

    def before_step(self) -> None:
        """Call before each step is run: starts and stops the window."""
        if self.steps == self.start:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        elif self.steps == self.start + self.count:
            self.finish()
        self.steps += 1

    def finish(self) -> None:
        """Stop and write the window, if one is open."""
        if self.prof is None:
            return
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"worker-{self.rank}"
        self.prof.export_chrome_trace(f"{stem}.json")
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        steps = min(self.steps, self.start + self.count) - self.start
        table = self.prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
        Path(f"{stem}.txt").write_text(f"worker {self.rank}: steps {self.start} to "
                                       f"{self.start + steps - 1} ({steps} steps)\n{table}\n")
        self.prof = None


def host_phase(profiler: StepProfiler | None, name: str):
    """A range named `name` on the trace's CPU timeline while a window is open; else nothing."""
    if profiler is None or profiler.prof is None:
        return contextlib.nullcontext()
    import torch

    return torch.profiler.record_function(name)
