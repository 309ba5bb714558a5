"""The engine's one step loop: schedule -> execute -> outputs.

`EngineCore` joins the Scheduler to an executor that runs its plans: the model runner in this
process (`LLM`; plans and results pass through the wire codec, so the in-process engine speaks
exactly the multi-process protocol), or the worker processes behind sockets (`conveyor serve`'s
scheduler process). An executor takes a plan with `submit(plan)` and gives results back in plan
order with `result(wait)`. With async scheduling up to two plans are in flight: the next step is
planned and queued while the previous one runs.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from conveyor.scheduler.mask_counts import mask_line
from conveyor.scheduler.scheduler import Scheduler
from conveyor.scheduler.spec_counts import spec_line
from conveyor.shared.config import EngineConfig
from conveyor.shared.messages.engine import AddRequest, Stats, TokenOutput
from conveyor.shared.messages.worker import StepPlan, StepResult
from conveyor.shared.model_config import ModelConfig
from conveyor.worker.profiling import host_phase

STATS_EVERY_S = 10.0                         # the periodic stats line, while busy


class Executor(Protocol):
    def submit(self, plan: StepPlan) -> None: ...

    def result(self, wait: bool) -> StepResult | None:
        """The next result in plan order; None if none is in (and not wait)."""


def max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context "
                         f"length {limit}")
    return config.max_model_len or limit


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor,
                 report: Callable[[str], None] | None = None, profiler=None):
        """report: where the stats line goes every STATS_EVERY_S while busy (None: nowhere);
        profiler: a StepProfiler (worker/profiling.py) of an in-process engine, or None."""
        self.scheduler = scheduler
        self.executor = executor
        self.profiler = profiler
        self.stalled = False                 # work waits, but nothing could be planned
        self.report = report
        self._last_log = (time.monotonic(), Stats())

    @classmethod
    def local(cls, config: EngineConfig):
        """The engine in this process: the scheduler and one model runner. Returns it with the
        runner (for its model files and quantization report)."""
        from conveyor.scheduler.policy import make_policy
        from conveyor.shared.model_files import engine_model
        from conveyor.worker.executor import LocalExecutor
        from conveyor.worker.model_runner import ModelRunner
        from conveyor.worker.profiling import StepProfiler

        policy = make_policy(config.scheduling_policy)   # a bad name fails before the model loads
        files, model = engine_model(config)
        length = max_model_len(config, model)
        profiler = StepProfiler.from_env(0, config.device == "cuda")
        runner = ModelRunner(config, model, files, length)
        scheduler = Scheduler(config, runner.num_blocks, model.eos_token_ids, length, policy)
        executor = LocalExecutor(runner, config.async_scheduling, wire=True)
        return cls(scheduler, executor, profiler=profiler), runner

    @property
    def busy(self) -> bool:
        """Whether step() has something to do now (else wait for a request or a result)."""
        return self.scheduler.can_schedule() and not self.stalled

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.scheduler.num_in_flight > 0

    def add(self, msg: AddRequest) -> list[TokenOutput]:
        self.stalled = False
        return self.scheduler.add(msg)

    def abort(self, ids: list[str], reason: str = "abort") -> list[TokenOutput]:
        self.stalled = False
        return self.scheduler.abort(ids, reason)

    def stats(self) -> Stats:
        self.scheduler.audit()
        return self.scheduler.stats()

    def step(self, wait: bool = True) -> list[TokenOutput]:
        """Plan and submit what can run now, then apply the next result: waiting for it if
        `wait`, else only if it is already in. Returns what the frontends should see."""
        prof = self.profiler
        while self.busy:
            with host_phase(prof, "conveyor: plan"):
                plan = self.scheduler.schedule()
            if plan is None:                 # until a result or a request comes
                self.stalled = True
                break
            if prof is not None:
                prof.before_step()
            with host_phase(prof, "conveyor: run a step"):
                self.executor.submit(plan)
        if not self.scheduler.num_in_flight:
            return []
        with host_phase(prof, "conveyor: wait for a result"):
            result = self.executor.result(wait)
        if result is None:
            return []
        self.stalled = False
        with host_phase(prof, "conveyor: apply a result"):
            outputs = self.scheduler.update(result)
        if self.report is not None:
            self._maybe_report()
        return outputs

    def _maybe_report(self) -> None:
        """Every STATS_EVERY_S while busy: throughput since the last line, queues, KV use."""
        now = time.monotonic()
        since, last = self._last_log
        if now - since < STATS_EVERY_S:
            return
        s = self.scheduler.stats()
        self._last_log = (now, s)
        if now - since > 3 * STATS_EVERY_S:   # it was idle: this result starts a new period
            return
        dt = now - since
        used = 1 - s.num_free_blocks / max(1, s.num_total_blocks)
        queries = s.prefix_cache_queries - last.prefix_cache_queries
        hits = s.prefix_cache_hits - last.prefix_cache_hits
        line = (f"prompt {(s.num_prompt_tokens - last.num_prompt_tokens) / dt:.1f} tok/s, "
                f"generation {(s.num_generated_tokens - last.num_generated_tokens) / dt:.1f} "
                f"tok/s, {s.num_running} running, {s.num_waiting} waiting, KV cache "
                f"{100 * used:.1f} % used, prefix cache hit rate "
                f"{100 * hits / max(1, queries):.1f} %")
        self.report(line + spec_line(s, last) + mask_line(s, last))
