"""The running server's children: spawn them, wait for each one's Ready, tell the frontends to
serve, print where it listens, then supervise until a stop signal or a death.

A dead frontend is reaped and its requests aborted while another serves. SIGINT/SIGTERM, whether
sent to the launcher alone, to its process group (Ctrl-C, systemd) or to it as a container's
PID 1, drain: the frontends refuse new requests and finish open ones (up to --shutdown-timeout),
the rest fail with a reason, then everything stops (exit 0); a second signal fails what is open
and stops at once. A signal during start-up stops what started (exit 0). The children ignore
signals meant for the group (shared/process.py). A child that dies fails every open request
(EngineDead to the frontends) and ends the launch (exit 1); with --data-parallel-size > 1 a
dying scheduler or worker takes only its replica down (the rest of it is stopped, the frontends
fail its requests and route around it) while another replica serves. With
--distributed-executor-backend ray the workers are Ray actors on other nodes (ray_workers.py),
supervised like the children.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import time

import zmq

from conveyor.frontend.server import frontend_main
from conveyor.scheduler.process import scheduler_main
from conveyor.shared import links
from conveyor.shared.config import ServeConfig
from conveyor.shared.messages.control import (
    Drain,
    Drained,
    EngineDead,
    FrontendDead,
    Ready,
    ReplicaDead,
)
from conveyor.shared.model_files import DEFAULT_MODEL_NAME
from conveyor.shared.process import child_main, spawning_children
from conveyor.shared.replicas import replica_of, scheduler_name, worker_name
from conveyor.shared.sockets import Socket, ipc
from conveyor.worker.process import worker_main

STOP_GRACE_S = 5.0         # SIGTERM, then SIGKILL after this long
FORCED_GRACE_S = 1.0       # the same after a second stop signal
DRAIN_S = 3.0              # how long frontends get to send their errors after a death
DRAIN_SLACK_S = 2.0        # beyond --shutdown-timeout, for the frontends' last replies


class LaunchError(Exception):
    """A start-up failure; its message is the one line the user sees."""


class _Stop(Exception):
    pass


def summary(cfg: ServeConfig, info: dict[str, dict]) -> str:
    """The start-up summary: what runs where, with which limits."""
    e, dp = cfg.engine, cfg.engine.data_parallel_size
    worker, scheduler = info.get(worker_name(0, 0, dp), {}), info.get(scheduler_name(0, dp), {})
    pp = e.pipeline_parallel_size
    blocks = int(worker.get("num_blocks", 0))
    replicas = (f"data parallel {dp} ({e.dp_routing_policy} routing) x " if dp > 1 else "")
    lines = [f"model {e.model or DEFAULT_MODEL_NAME}, {worker.get('dtype')} on "
             f"{worker.get('device')}, {replicas}"
             f"{f'pipeline parallel {pp} x ' if pp > 1 else ''}"
             f"tensor parallel {e.tensor_parallel_size}"
             f"{' (workers on Ray)' if cfg.links is not None else ''}, "
             f"{cfg.num_frontends} frontend(s)",
             f"KV cache {blocks:,} blocks of {e.block_size} = {blocks * e.block_size:,} tokens "
             f"({worker.get('kv_dtype')}{', per replica' if dp > 1 else ''}"
             f"{', each stage its own layers' if pp > 1 else ''}); "
             f"max model length {scheduler.get('max_model_len')}",
             f"a step: up to {scheduler.get('max_num_batched_tokens')} tokens and "
             f"{e.max_num_seqs} sequences; "
             f"waiting requests beyond {scheduler.get('queue_cap') or 'none'} are refused"]
    if "quantization" in worker:
        lines.append(str(worker["quantization"]))
    return "\n".join(f"conveyor: {line}" for line in lines)


class Supervisor:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.control = Socket(self.ctx, zmq.PULL, ipc(cfg.runtime_dir, "launcher"), bind=True,
                              allowed=(Ready, EngineDead, Drained))
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.dead: set[str] = set()          # children whose exit was seen
        self.schedulers: dict[int, Socket] = {}   # by replica: to tell of a dead frontend
        self._unread: list = []              # control messages read early, for _poll to return
        self.controls = [self.control]       # and, with Ray workers, their TCP link here
        self.cluster = None                  # the Ray placement, with Ray workers
        self._auth = None                    # the ZAP handler admitting only Ray workers
        self.ready: set[str] = set()          # children that reported Ready
        self.signals = 0                     # stop signals received
        self.lost: set[int] = set()          # data-parallel replicas that died

    def run(self, startup_timeout: float) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        grace, serving = STOP_GRACE_S, False
        try:
            self._spawn(startup_timeout)
            started = time.monotonic()
            info = self._wait_ready(startup_timeout)
            # NOTE: "serving on" waits until every frontend has taken the Ready: a client that
            # reads it and connects at once must not meet "the server is starting"
            self._await_frontends(self._tell_frontends(Ready("launcher")), Ready)
            print(summary(self.cfg, info), flush=True)
            http = self.cfg.http
            addresses = [info[k]["address"] for k in sorted(info) if "address" in info[k]]
            where = ([f"{http.scheme}://{self.cfg.host}:{http.port} (HTTP)"]
                     if http.port is not None else []) + [f"{', '.join(addresses)} (ZMQ)"]
            print(f"conveyor: serving on {', '.join(where)}; ready in "
                  f"{time.monotonic() - started:.1f} s, pid {os.getpid()}", flush=True)
            serving = True
            try:
                dead = self._supervise()
            except _Stop:
                try:
                    dead = self._drain()
                except _Stop:                    # a second signal: stop now
                    grace = FORCED_GRACE_S
                    self._stop_now()
                    return 0
                if dead is None:
                    return 0
            print(f"conveyor: error: {dead}; stopped the server", file=sys.stderr, flush=True)
            return 1
        except LaunchError as e:
            if self.signals:                     # a child that the stop signal ended first
                return 0
            print(f"conveyor: error: {e}", file=sys.stderr, flush=True)
            return 1
        except _Stop:
            if not serving:
                print("conveyor: stopped during start-up", file=sys.stderr, flush=True)
            return 0
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self._stop_all(grace)
            if self.cluster is not None:
                self.cluster.close()
            for sock in [*self.schedulers.values(), *self.controls]:
                sock.close()
            if self._auth is not None:
                self._auth.stop()
            self.ctx.destroy(linger=0)
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        raise _Stop()

    def _stop_now(self) -> None:
        """After a second stop signal: fail what is still open, waiting at most a second."""
        print("conveyor: stopping now", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._await_frontends(self._tell_frontends(EngineDead("the server was stopped")),
                              Drained, FORCED_GRACE_S)

    def _spawn(self, timeout_s: float) -> None:
        spawn = mp.get_context("spawn")
        e = self.cfg.engine
        dp, roles = e.data_parallel_size, []
        on_ray = e.distributed_executor_backend == "ray"
        if on_ray:
            self._place_on_ray(timeout_s)
        for replica in range(dp):
            if not on_ray:
                roles += [(worker_name(replica, r, dp), worker_main, (r, replica))
                          for r in range(e.world_size)]
            roles.append((scheduler_name(replica, dp), scheduler_main, (replica,)))
        roles += [(f"frontend-{i}", frontend_main, (i,)) for i in range(self.cfg.num_frontends)]
        for name, main, args in roles:
            proc = spawn.Process(target=child_main, args=(name, main, self.cfg, *args),
                                 name=f"conveyor::{name}", daemon=False)
            with spawning_children():
                proc.start()
            self.procs[name] = proc
        if on_ray:
            self.procs.update(self.cluster.start(self.cfg))

    def _place_on_ray(self, timeout_s: float) -> None:
        """Place the workers on the Ray cluster (not started yet); the links they will take to
        this host's scheduler and launcher."""
        from conveyor.ray_workers import RayCluster

        try:
            self.cluster = RayCluster.connect(self.cfg.engine, timeout_s)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        print(f"conveyor: Ray placement: {self.cluster.describe()}", flush=True)
        self.cfg = dataclasses.replace(self.cfg, links=self.cluster.links())
        self._auth = links.admit_workers(self.ctx, self.cfg)
        try:
            self.controls.append(links.bind(self.ctx, zmq.PULL, self.cfg, "control",
                                            allowed=(Ready, EngineDead)))
        except zmq.ZMQError as e:
            raise LaunchError(f"cannot listen on {links.address(self.cfg, 'control')} for the "
                              f"Ray workers: {e}") from None

    def _poll(self, timeout_s: float | None) -> tuple[object | None, str | None]:
        """(a control message, or the name of a child that exited), either may be None."""
        if self._unread:
            return self._unread.pop(0), None
        poller = zmq.Poller()
        for control in self.controls:
            poller.register(control.sock, zmq.POLLIN)
        sentinels = {p.sentinel: name for name, p in self.procs.items() if name not in self.dead}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        events = dict(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))
        for control in self.controls:
            if control.sock in events:
                return control.recv()[1], None
        for fd, name in sentinels.items():
            if fd in events:
                return None, name
        return None, None

    def _wait_ready(self, timeout_s: float) -> dict[str, dict]:
        """Each child's Ready info, by role."""
        deadline = time.monotonic() + timeout_s
        waiting = set(self.procs)
        info: dict[str, dict] = {}
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
                self.ready.add(msg.role)
                info[msg.role] = msg.info
        return info

    def _supervise(self) -> str:
        """Block until the engine fails; fail every open request; return what died. A frontend
        that dies while another one serves only loses its own requests."""
        while True:
            msg, exited = self._poll(None)
            if self._replica_lost(msg, exited):
                continue
            role = exited or (msg.role if isinstance(msg, EngineDead) else "")
            if role.startswith("frontend-") and any(
                    n.startswith("frontend-") and n != role and n not in self.dead
                    for n in self.procs):
                self._lose_frontend(role)
                continue
            reason = self._death(msg, exited)
            if reason is not None:
                self._fail_requests(reason)
                return reason

    def _lose_frontend(self, role: str) -> None:
        """Reap a dead frontend; the scheduler aborts its requests (nobody can receive them)."""
        from conveyor.frontend.metrics import mark_process_dead

        proc = self.procs[role]
        proc.join(STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        self.dead.add(role)
        mark_process_dead(proc.pid)
        dp = self.cfg.engine.data_parallel_size
        for replica in sorted(set(range(dp)) - self.lost):
            if replica not in self.schedulers:
                self.schedulers[replica] = Socket(
                    self.ctx, zmq.DEALER, ipc(self.cfg.runtime_dir, scheduler_name(replica, dp)),
                    bind=False, identity=b"launcher")
            self.schedulers[replica].send(FrontendDead(role))
        alive = sum(n.startswith("frontend-") and n not in self.dead for n in self.procs)
        print(f"conveyor: warning: {role} (pid {proc.pid}) died with exit code {proc.exitcode}; "
              f"{alive} frontend(s) still serving", file=sys.stderr, flush=True)

    def _replica_lost(self, msg, exited: str | None) -> bool:
        """With several replicas: whether this poll result is (the end of) a replica's death
        while another one serves; the first such takes the rest of that replica down and tells
        the frontends, which fail its requests."""
        role = exited or (msg.role if isinstance(msg, EngineDead) else "")
        replica = replica_of(role) if role else None
        dp = self.cfg.engine.data_parallel_size
        if dp == 1 or replica is None:
            return False
        if replica in self.lost:             # its other members, stopped by us
            if exited is not None:
                self.dead.add(exited)
            return True
        if len(self.lost) + 1 >= dp:         # the last one: the engine is gone
            return False
        reason = msg.reason if isinstance(msg, EngineDead) else None
        self.lost.add(replica)
        members = [n for n in self.procs if replica_of(n) == replica]
        for name in members:
            proc = self.procs[name]
            if proc.is_alive():
                proc.kill()
            proc.join()
            self.dead.add(name)
        if reason is None:
            proc = self.procs[exited]
            reason = f"{exited} (pid {proc.pid}) died with exit code {proc.exitcode}"
        self._tell_frontends(ReplicaDead(replica, f"data-parallel replica {replica} failed: "
                                                  f"{reason}"))
        print(f"conveyor: warning: replica {replica} stopped ({reason}); {dp - len(self.lost)} "
              f"replica(s) still serving", file=sys.stderr, flush=True)
        return True

    def _death(self, msg, exited: str | None) -> str | None:
        """What died, if this poll result says a child died."""
        if isinstance(msg, EngineDead):
            return msg.reason
        if exited is None:
            return None
        self.dead.add(exited)
        proc = self.procs[exited]
        proc.join(0.1)
        return f"{exited} (pid {proc.pid}) died with exit code {proc.exitcode}"

    def _drain(self) -> str | None:
        """SIGTERM: let the frontends finish open requests; what died meanwhile, if anything."""
        timeout = self.cfg.http.shutdown_timeout
        print(f"conveyor: draining (up to {timeout:g} s); signal again to stop at once",
              file=sys.stderr, flush=True)
        waiting = self._tell_frontends(Drain(timeout))
        deadline = time.monotonic() + timeout + DRAIN_SLACK_S
        while waiting and time.monotonic() < deadline:
            msg, exited = self._poll(deadline - time.monotonic())
            if isinstance(msg, Drained):
                waiting.discard(msg.role)
                continue
            if self._replica_lost(msg, exited):
                continue
            reason = self._death(msg, exited)
            if reason is not None:
                self._fail_requests(reason)
                return reason
        return None

    def _fail_requests(self, reason: str) -> None:
        """EngineDead to the frontends; wait (a little) until each has failed its requests."""
        self._await_frontends(self._tell_frontends(EngineDead(f"the engine failed: {reason}")),
                              Drained)

    def _await_frontends(self, waiting: set[str], reply: type, timeout_s: float = DRAIN_S
                         ) -> None:
        """Wait (a little) until each frontend in `waiting` answered with a `reply` message or
        exited; a death is left for _supervise to find."""
        deadline = time.monotonic() + timeout_s
        other = []
        while waiting and time.monotonic() < deadline:
            msg, exited = self._poll(deadline - time.monotonic())
            if isinstance(msg, reply):
                waiting.discard(msg.role)
            elif msg is not None:
                other.append(msg)
            elif exited is not None:
                waiting.discard(exited)
        self._unread += other                    # for _supervise

    def _tell_frontends(self, msg) -> set[str]:
        """Send msg to every live frontend; returns their names."""
        told = set()
        for name, proc in self.procs.items():
            if name.startswith("frontend-") and proc.is_alive():
                push = Socket(self.ctx, zmq.PUSH, ipc(self.cfg.runtime_dir, name), bind=False)
                push.send(msg)
                push.close(linger_ms=1000)
                told.add(name)
        return told

    def _stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the children that started (frontends first), SIGKILL to those still
        loading (they hold nothing to finish, and may not take a SIGTERM yet: see
        shared/process.py) and to any left after grace_s."""
        order = sorted(self.procs.items(), key=lambda p: not p[0].startswith("frontend-"))
        for name, proc in order:
            if proc.is_alive():
                if name in self.ready:
                    proc.terminate()
                else:
                    proc.kill()
        deadline = time.monotonic() + grace_s
        for _, proc in order:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
