"""`conveyor serve`: start the frontends, the scheduler and the workers, then watch them.

Checks what it can before spawning (model files, tensor-parallel split), spawns every child
with the 'spawn' start method, waits for each one's Ready, prints where it listens, and then
supervises: SIGINT/SIGTERM stop everything (exit 0); a child that dies fails every open request
(EngineDead to the frontends) and ends the launch (exit 1). Start-up failures print one line.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time

import zmq

from conveyor.engine import max_model_len
from conveyor.frontend.server import frontend_main
from conveyor.scheduler.process import scheduler_main
from conveyor.shared.config import ModelConfig, ServeConfig
from conveyor.shared.messages import EngineDead, Ready
from conveyor.shared.model_files import read_model_config, resolve_model
from conveyor.shared.process import child_main
from conveyor.shared.sockets import Socket, ipc, make_runtime_dir, remove_runtime_dir
from conveyor.worker.process import worker_main

STOP_GRACE_S = 5.0         # SIGTERM, then SIGKILL after this long
DRAIN_S = 3.0              # how long frontends get to send their errors after a death


class LaunchError(Exception):
    """A start-up failure; its message is the one line the user sees."""


class _Stop(Exception):
    pass


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if heads % tp:
        raise LaunchError(f"--tp {tp} does not divide the model's {heads} attention heads")
    if kv % tp and tp % kv:
        raise LaunchError(f"--tp {tp} neither divides the model's {kv} KV heads nor is a "
                          f"multiple of them")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(engine, host: str, zmq_port: int, num_frontends: int, curve_keys: str | None,
          startup_timeout: float) -> int:
    model = read_model_config(resolve_model(engine.model))
    check_tensor_parallel(model, engine.tensor_parallel_size)
    max_model_len(engine, model)
    runtime_dir = make_runtime_dir()
    try:
        cfg = ServeConfig(engine, str(runtime_dir), os.getpid(), host, zmq_port, num_frontends,
                          curve_keys, free_port())
        return Launcher(cfg).run(startup_timeout)
    finally:
        remove_runtime_dir(runtime_dir)


class Launcher:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.control = Socket(self.ctx, zmq.PULL, ipc(cfg.runtime_dir, "launcher"), bind=True,
                              allowed=(Ready, EngineDead))
        self.procs: dict[str, mp.process.BaseProcess] = {}

    def run(self, startup_timeout: float) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._spawn()
            addresses = self._wait_ready(startup_timeout)
            print(f"conveyor: serving on {', '.join(addresses)} (ZMQ; tp="
                  f"{self.cfg.engine.tensor_parallel_size}, frontends={self.cfg.num_frontends}, "
                  f"pid {os.getpid()})", flush=True)
            dead = self._supervise()
            print(f"conveyor: error: {dead}; stopped the server", file=sys.stderr, flush=True)
            return 1
        except LaunchError as e:
            print(f"conveyor: error: {e}", file=sys.stderr, flush=True)
            return 1
        except _Stop:
            return 0
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self._stop_all()
            self.control.close()
            self.ctx.destroy(linger=0)
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        raise _Stop()

    def _spawn(self) -> None:
        spawn = mp.get_context("spawn")
        roles = [(f"worker-{r}", worker_main, (r,))
                 for r in range(self.cfg.engine.tensor_parallel_size)]
        roles.append(("scheduler", scheduler_main, ()))
        roles += [(f"frontend-{i}", frontend_main, (i,)) for i in range(self.cfg.num_frontends)]
        for name, main, args in roles:
            proc = spawn.Process(target=child_main, args=(name, main, self.cfg, *args),
                                 name=f"conveyor::{name}", daemon=False)
            proc.start()
            self.procs[name] = proc

    def _poll(self, timeout_s: float | None) -> tuple[object | None, str | None]:
        """(a control message, or the name of a child that exited), either may be None."""
        poller = zmq.Poller()
        poller.register(self.control.sock, zmq.POLLIN)
        sentinels = {p.sentinel: name for name, p in self.procs.items()}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        events = dict(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))
        if self.control.sock in events:
            return self.control.recv()[1], None
        for fd, name in sentinels.items():
            if fd in events:
                return None, name
        return None, None

    def _wait_ready(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.procs)
        addresses: dict[str, str] = {}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"start-up timed out after {timeout_s:.0f} s waiting for "
                                  f"{', '.join(sorted(waiting))}")
            msg, exited = self._poll(left)
            if exited is not None:
                msg, _ = self._poll(0.5)         # its own report says more than an exit code
                if not isinstance(msg, EngineDead):
                    raise LaunchError(f"{exited} exited with code "
                                      f"{self.procs[exited].exitcode} during start-up")
            if isinstance(msg, EngineDead):
                raise LaunchError(msg.reason)
            if isinstance(msg, Ready):
                waiting.discard(msg.role)
                if "address" in msg.info:
                    addresses[msg.role] = str(msg.info["address"])
        return [addresses[k] for k in sorted(addresses)]

    def _supervise(self) -> str:
        """Block until a child dies; fail every open request; return what died."""
        while True:
            msg, exited = self._poll(None)
            if exited is None and not isinstance(msg, EngineDead):
                continue
            if isinstance(msg, EngineDead):
                reason = msg.reason
            else:
                proc = self.procs[exited]
                proc.join(0.1)
                reason = f"{exited} (pid {proc.pid}) died with exit code {proc.exitcode}"
            self._notify_frontends(f"the engine failed: {reason}")
            return reason

    def _notify_frontends(self, reason: str) -> None:
        frontends = [(n, p) for n, p in self.procs.items() if n.startswith("frontend-")]
        for name, proc in frontends:
            if proc.is_alive():
                push = Socket(self.ctx, zmq.PUSH, ipc(self.cfg.runtime_dir, name), bind=False)
                push.send(EngineDead(reason))
                push.close(linger_ms=1000)
        deadline = time.monotonic() + DRAIN_S
        for _, proc in frontends:
            proc.join(max(0.0, deadline - time.monotonic()))

    def _stop_all(self) -> None:
        order = sorted(self.procs.values(), key=lambda p: not p.name.startswith("conveyor::front"))
        for proc in order:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in order:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
