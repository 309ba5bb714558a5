"""The executor of a model runner in this process: plans in, results out in plan order.

`LLM` runs the engine over one (with `wire=True`: plans and results pass through the message
codec, as they would between processes); a worker process runs one behind its sockets. With
async scheduling `submit` queues a plan's forward pass before it takes the previous step's
result, so the device never waits for the host.
"""
from __future__ import annotations

from collections import deque

from conveyor.shared.messages import through_wire
from conveyor.shared.messages.worker import StepPlan, StepResult


class LocalExecutor:
    def __init__(self, runner, overlap: bool, wire: bool = False):
        self.runner = runner
        self.overlap = overlap
        self.wire = wire
        self.ready: deque[StepResult] = deque()   # results taken from the runner, not handed out

    def submit(self, plan: StepPlan) -> None:
        plan = through_wire(plan) if self.wire else plan
        self._keep(self.runner.submit(plan) if self.overlap else self.runner.execute(plan))

    def result(self, wait: bool) -> StepResult | None:
        if not self.ready and self.runner.in_flight and (wait or self.runner.step_done()):
            self._keep(self.runner.flush())
        return self.ready.popleft() if self.ready else None

    def _keep(self, result: StepResult | None) -> None:
        if result is not None:
            self.ready.append(through_wire(result) if self.wire else result)
