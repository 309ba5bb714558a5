"""The scheduler process: the Scheduler behind sockets, between the frontends and the workers.

Frontends (DEALERs, one identity each) send AddRequest, Abort and StatsRequest to its ROUTER; each
request's outputs go back only to the frontend that added it. The launcher sends FrontendDead
there when a frontend died: its requests are aborted, which frees their blocks. Every StepPlan is
encoded once and pushed to every worker rank; rank 0 pushes back the StepResult. With async
scheduling it plans the next step as soon as one is sent, so up to two are in flight and the
workers never wait for it. With nothing to do it blocks in poll, so an idle server spins no core.
"""
from __future__ import annotations

from collections import defaultdict

import zmq

from conveyor.engine import max_model_len
from conveyor.scheduler.scheduler import Scheduler
from conveyor.shared.config import ServeConfig
from conveyor.shared.messages import (
    Abort,
    AddRequest,
    ErrorReply,
    FrontendDead,
    Ready,
    StatsRequest,
    StepResult,
    TokenOutput,
    TokenOutputs,
    encode,
)
from conveyor.shared.model_files import read_model_config, resolve_model
from conveyor.shared.process import StartupError
from conveyor.shared.sockets import Socket, ipc


def scheduler_main(ctx: zmq.Context, control: Socket, cfg: ServeConfig) -> None:
    model = read_model_config(resolve_model(cfg.engine.model))
    frontends = Socket(ctx, zmq.ROUTER, ipc(cfg.runtime_dir, "scheduler"), bind=True,
                       allowed=(AddRequest, Abort, StatsRequest, FrontendDead))
    results = Socket(ctx, zmq.PULL, ipc(cfg.runtime_dir, "results"), bind=True,
                     allowed=(StepResult, Ready))
    workers = [Socket(ctx, zmq.PUSH, ipc(cfg.runtime_dir, f"worker-{r}"), bind=True)
               for r in range(cfg.engine.tensor_parallel_size)]
    _, ready = results.recv()                # rank 0 says how many KV blocks every rank has
    num_blocks = int(ready.info["num_blocks"])
    if num_blocks < cfg.engine.max_num_seqs:
        raise StartupError(f"the KV cache has {num_blocks} blocks, fewer than max_num_seqs="
                         f"{cfg.engine.max_num_seqs} (one block per request); raise "
                         f"--kv-cache-memory-bytes or lower --max-num-seqs")
    scheduler = Scheduler(cfg.engine, num_blocks, model.eos_token_ids,
                          max_model_len(cfg.engine, model), derive_queue_cap=True)
    control.send(Ready("scheduler", {"num_blocks": num_blocks}))
    SchedulerLoop(scheduler, frontends, results, workers).run()


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, frontends: Socket, results: Socket,
                 workers: list[Socket]):
        self.scheduler = scheduler
        self.frontends = frontends
        self.results = results
        self.workers = workers
        self.owner: dict[str, bytes] = {}    # sequence id -> identity of the frontend that added it

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontends.sock, zmq.POLLIN)
        poller.register(self.results.sock, zmq.POLLIN)
        stalled = False                      # work waiting, but nothing could be planned
        while True:
            busy = self.scheduler.can_schedule() and not stalled
            events = dict(poller.poll(0 if busy else None))
            outputs: list[TokenOutput] = []
            if self.frontends.sock in events:
                while self.frontends.sock.poll(0):
                    outputs += self._on_frontend(*self.frontends.recv())
            if self.results.sock in events:
                _, result = self.results.recv()
                if not isinstance(result, StepResult):
                    raise RuntimeError(f"worker 0 sent {type(result).__name__}, not a StepResult")
                outputs += self.scheduler.update(result)
            self._send_outputs(outputs)
            stalled = False
            if self.scheduler.can_schedule():
                plan = self.scheduler.schedule()
                if plan is None:             # until a result or a frontend message comes
                    stalled = True
                    continue
                frames = encode(plan)
                for worker in self.workers:
                    worker.send_frames(frames)

    def _on_frontend(self, peer: bytes, msg) -> list[TokenOutput]:
        if isinstance(msg, AddRequest):
            self.owner[msg.id] = peer
            return self.scheduler.add(msg)
        if isinstance(msg, Abort):
            return self.scheduler.abort(msg.ids, msg.reason)
        if isinstance(msg, FrontendDead):
            dead = msg.role.encode()
            return self.scheduler.abort([i for i, p in self.owner.items() if p == dead])
        if isinstance(msg, StatsRequest):
            self.scheduler.audit()
            self.frontends.send(self.scheduler.stats(), to=peer)
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
