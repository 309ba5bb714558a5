"""The engine core in one process: the scheduler and a model runner joined by a channel.

The channel carries the same encoded messages as the ZeroMQ transport between processes, so the
in-process engine (the offline API, tests) speaks exactly the multi-process protocol. With async
scheduling a step queues the next plan on the device before it takes the previous one's result.
"""
from __future__ import annotations

from conveyor.scheduler.policy import make_policy
from conveyor.scheduler.scheduler import Scheduler
from conveyor.shared.config import EngineConfig, ModelConfig
from conveyor.shared.messages import AddRequest, StepPlan, StepResult, TokenOutput, decode, encode
from conveyor.shared.model_files import ModelFiles, read_model_config, resolve_model
from conveyor.worker.profiling import host_phase


def max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context "
                         f"length {limit}")
    return config.max_model_len or limit


class EngineCore:
    def __init__(self, config: EngineConfig, files: ModelFiles | None = None):
        from conveyor.worker.model_runner import ModelRunner
        from conveyor.worker.profiling import StepProfiler

        self.config = config
        policy = make_policy(config.scheduling_policy)   # a bad name fails before the model loads
        self.files = files or resolve_model(config.model)
        self.model_config = read_model_config(self.files)
        self.max_model_len = max_model_len(config, self.model_config)
        self.profiler = StepProfiler.from_env(0, config.device == "cuda")
        self.runner = ModelRunner(config, self.model_config, self.files, self.max_model_len)
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.model_config.eos_token_ids,
                                   self.max_model_len, policy)

    def add(self, msg: AddRequest) -> list[TokenOutput]:
        return self.scheduler.add(decode(encode(msg), (AddRequest,)))

    def abort(self, ids: list[str], reason: str = "abort") -> list[TokenOutput]:
        return self.scheduler.abort(ids, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenOutput]:
        """Plan and submit steps until one result comes back (or nothing more can be planned,
        then wait for the step in flight); returns what that result gives the frontends."""
        outputs = None
        while outputs is None and self.scheduler.can_schedule():
            with host_phase(self.profiler, "conveyor: plan"):
                plan = self.scheduler.schedule()
            if plan is None:
                break
            if self.profiler is not None:
                self.profiler.before_step()
            with host_phase(self.profiler, "conveyor: run a step"):
                result = self.runner.submit(decode(encode(plan), (StepPlan,)))
            if result is not None:
                outputs = self._update(result)
        if outputs is None:
            with host_phase(self.profiler, "conveyor: wait for a result"):
                result = self.runner.flush()
            outputs = [] if result is None else self._update(result)
        if not self.scheduler.has_work():     # a step in flight holds finished requests only
            while (result := self.runner.flush()) is not None:
                self._update(result)
        return outputs

    def _update(self, result: StepResult) -> list[TokenOutput]:
        with host_phase(self.profiler, "conveyor: apply a result"):
            return self.scheduler.update(decode(encode(result), (StepResult,)))
