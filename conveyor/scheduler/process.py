"""The scheduler process: the EngineCore's step loop behind sockets, between frontends and workers.

With --data-parallel-size N there are N of these, one per replica, each with its own workers
and sockets (conveyor/shared/replicas.py names them); they share nothing.

Frontends (DEALERs, one identity each) send AddRequest, Abort and StatsRequest to its ROUTER; each
request's outputs go back only to the frontend that added it, in one TokenOutputs per step. The
launcher sends FrontendDead there when a frontend died: its requests are aborted, which frees
their blocks. The workers are the engine's executor: every StepPlan is encoded once and pushed to
every rank (PP x TP of them); the sampling rank pushes back the StepResult. With nothing to do
it blocks in poll, so an idle server spins no core.
"""
from __future__ import annotations

from collections import defaultdict

import zmq

from conveyor.engine import EngineCore, max_model_len
from conveyor.scheduler.scheduler import Scheduler
from conveyor.shared import links
from conveyor.shared.config import ServeConfig
from conveyor.shared.messages import encode
from conveyor.shared.messages.client import ErrorReply
from conveyor.shared.messages.control import FrontendDead, Ready
from conveyor.shared.messages.engine import (
    Abort,
    AddRequest,
    StatsRequest,
    TokenOutput,
    TokenOutputs,
)
from conveyor.shared.messages.worker import StepPlan, StepResult
from conveyor.shared.model_files import engine_model
from conveyor.shared.process import StartupError
from conveyor.shared.replicas import results_name, scheduler_name, worker_name
from conveyor.shared.sockets import Socket, ipc


class Workers:
    """The executor of `conveyor serve`: the worker processes, over sockets."""

    def __init__(self, ctx: zmq.Context, cfg: ServeConfig, replica: int = 0):
        dp = cfg.engine.data_parallel_size
        self.results = links.bind(ctx, zmq.PULL, cfg, results_name(replica, dp),
                                  allowed=(StepResult, Ready))
        self.ranks = [links.bind(ctx, zmq.PUSH, cfg, worker_name(replica, r, dp))
                      for r in range(cfg.engine.world_size)]

    def submit(self, plan: StepPlan) -> None:
        frames = encode(plan)
        for rank in self.ranks:
            rank.send_frames(frames)

    def result(self, wait: bool) -> StepResult | None:
        if not wait and not self.results.sock.poll(0):
            return None
        _, result = self.results.recv()
        if not isinstance(result, StepResult):
            raise RuntimeError(f"worker 0 sent {type(result).__name__}, not a StepResult")
        return result


def scheduler_main(ctx: zmq.Context, control: Socket, cfg: ServeConfig, replica: int = 0) -> None:
    model = engine_model(cfg.engine)[1]
    name = scheduler_name(replica, cfg.engine.data_parallel_size)
    frontends = Socket(ctx, zmq.ROUTER, ipc(cfg.runtime_dir, name), bind=True,
                       allowed=(AddRequest, Abort, StatsRequest, FrontendDead))
    links.admit_workers(ctx, cfg)            # runs as long as the process
    workers = Workers(ctx, cfg, replica)
    # the sampling rank says how many KV blocks every rank has, and on which device they run
    _, ready = workers.results.recv()
    num_blocks = int(ready.info["num_blocks"])
    config = cfg.engine.with_defaults(offline=False, cuda=ready.info["device"] == "cuda")
    if num_blocks < config.max_num_seqs:
        raise StartupError(f"the KV cache has {num_blocks} blocks, fewer than max_num_seqs="
                           f"{config.max_num_seqs} (one block per request); raise "
                           f"--kv-cache-memory-bytes or lower --max-num-seqs")
    length = max_model_len(config, model)
    scheduler = Scheduler(config, num_blocks, model.eos_token_ids, length, derive_queue_cap=True)
    control.send(Ready(name, {"max_model_len": length,
                                     "max_num_batched_tokens": config.max_num_batched_tokens,
                                     "queue_cap": scheduler.admission.queue_cap() or 0}))
    engine = EngineCore(scheduler, workers, report=lambda line: print(f"conveyor: {line}",
                                                                      flush=True))
    SchedulerLoop(engine, frontends).run()


class SchedulerLoop:
    def __init__(self, engine: EngineCore, frontends: Socket):
        self.engine = engine
        self.frontends = frontends
        self.owner: dict[str, bytes] = {}    # sequence id -> identity of the frontend that added it

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontends.sock, zmq.POLLIN)
        poller.register(self.engine.executor.results.sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll(0 if self.engine.busy else None))
            outputs: list[TokenOutput] = []
            if self.frontends.sock in events:
                while self.frontends.sock.poll(0):
                    outputs += self._on_frontend(*self.frontends.recv())
            outputs += self.engine.step(wait=False)
            self._send_outputs(outputs)

    def _on_frontend(self, peer: bytes, msg) -> list[TokenOutput]:
        if isinstance(msg, AddRequest):
            self.owner[msg.id] = peer
            return self.engine.add(msg)
        if isinstance(msg, Abort):
            return self.engine.abort(msg.ids, msg.reason)
        if isinstance(msg, FrontendDead):
            dead = msg.role.encode()
            return self.engine.abort([i for i, p in self.owner.items() if p == dead])
        if isinstance(msg, StatsRequest):
            self.frontends.send(self.engine.stats(), to=peer)
        elif isinstance(msg, ErrorReply):
            pass                             # malformed; already logged by the socket
        return []

    def _send_outputs(self, outputs: list[TokenOutput]) -> None:
        by_peer: dict[bytes, list[TokenOutput]] = defaultdict(list)
        for out in outputs:
            peer = self.owner.pop(out.id) if out.finish_reason else self.owner.get(out.id)
            if peer is not None:
                by_peer[peer].append(out)
        for peer, outs in by_peer.items():
            self.frontends.send(TokenOutputs(outs), to=peer)
