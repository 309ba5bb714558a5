"""Workers as Ray actors (`--distributed-executor-backend ray`), for engines that span hosts.

The launcher joins an existing Ray cluster (RAY_ADDRESS, else the cluster this host is part of),
reserves a placement-group bundle per worker of each replica ({"GPU": 1, "CPU": 1} on GPU,
{"CPU": 1} on CPU) and starts each worker as an actor that runs the worker process's own main
(worker/process.py). A replica that fits one node is packed onto one node; else each pipeline
stage's tensor-parallel group is packed onto one node (stage s on its own node where the
cluster's shape allows); else (a tensor-parallel group larger than any node) Ray packs the ranks
onto as few nodes as it can. The scheduler and the frontends stay on this host; the workers reach
them by TCP under CurveZMQ (shared/links.py), and a replica's ranks meet at its rank 0's node.

To the launcher an actor is a child process (RayWorker: a sentinel to poll, is_alive, kill,
join, exitcode), so an actor that dies, or whose node does, is a worker that died. Ray itself
stays optional: it is imported here only, when the backend is asked for.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

from conveyor.shared.config import EngineConfig, ServeConfig
from conveyor.shared.links import TcpLinks, free_port
from conveyor.shared.replicas import results_name, worker_name

CONNECT_PROBE_S = 5.0          # a Ray address that accepts no connection in this long is down
NODES_NOTE_EVERY_S = 15.0      # while waiting for nodes to join: a line this often
KILL_WAIT_S = 10.0             # the longest wait for Ray to confirm that a killed actor ended


class WorkerHost:
    """The actor: says where it runs, then runs the worker main until it returns."""

    def where(self) -> dict:
        import ray

        ip = ray.util.get_node_ip_address()
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip,
                "pid": os.getpid(), "port": free_port(ip)}

    def run(self, name: str, cfg: ServeConfig, rank: int, replica: int) -> int:
        """The worker's exit code (0: it was told to stop; 1: it failed and said why)."""
        from conveyor.shared.process import run_role
        from conveyor.worker.process import worker_main

        return run_role(name, worker_main, cfg, "control", rank, replica)


class RayWorker:
    """An actor as the launcher sees a child process, once its worker main runs."""

    def __init__(self, ray, actor, where: dict):
        self._ray, self.actor, self.where = ray, actor, where
        self.pid = where["pid"]
        self.exitcode: int | None = None
        self.sentinel, self._write_end = os.pipe()     # readable (EOF) once run() has ended
        self._ended = threading.Event()

    def start(self, name: str, cfg: ServeConfig, rank: int, replica: int) -> None:
        ref = self.actor.run.remote(name, cfg, rank, replica)
        threading.Thread(target=self._watch, args=(ref,), name=f"watch-{name}",
                         daemon=True).start()

    def _watch(self, ref) -> None:
        try:
            self.exitcode = int(self._ray.get(ref))
        except Exception:                    # the actor died: its process, or its node
            self.exitcode = 1
        self._ended.set()
        os.close(self._write_end)

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)

    terminate = kill                         # a worker holds nothing to finish

    def join(self, timeout: float | None = None) -> None:
        # NOTE: Ray confirms a killed actor's end within a second or so; one it cannot confirm
        # (its cluster gone) is given up after KILL_WAIT_S rather than waited for forever
        self._ended.wait(KILL_WAIT_S if timeout is None else timeout)


def layout(per_node: list[float], tp: int, pp: int) -> list[tuple[str, int]]:
    """One replica's placement groups as (strategy, bundles), given how many workers each node
    can hold: the whole replica on one node; else each stage's TP group on one node; else TP
    groups over nodes, packed as tightly as Ray can."""
    biggest = max(per_node, default=0)
    if biggest >= tp * pp:
        return [("STRICT_PACK", tp * pp)]
    if biggest >= tp:
        return [("STRICT_PACK", tp)] * pp
    return [("PACK", tp * pp)]


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray, on this host and on "
                         "every node: pip install 'conveyor[ray]'") from None
    return ray


def _probe(address: str) -> None:
    """ValueError unless the Ray cluster at `address` (RAY_ADDRESS or "auto") accepts a
    connection: ray.init retries an address that is down for minutes."""
    if address == "auto":
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        try:
            address = current.read_text().strip()
        except OSError:
            return                           # ray.init says at once that none runs here
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_PROBE_S).close()
    except OSError as e:
        raise ValueError(f"no Ray cluster answers at {address} ({e}): start one with `ray start "
                         f"--head`, or point RAY_ADDRESS at its head (HOST:6379)") from None


class RayCluster:
    """This launch's share of a Ray cluster: its placement groups and worker actors."""

    def __init__(self, ray):
        self.ray = ray
        self.groups: list = []
        self.actors: list[list] = []         # per replica, by rank
        self.where: list[list[dict]] = []    # per replica, by rank
        self.workers: dict[str, RayWorker] = {}

    @classmethod
    def connect(cls, engine: EngineConfig, timeout_s: float) -> RayCluster:
        """Join the cluster and place every worker actor (not running yet); ValueError with
        the reason when Ray is missing, no cluster answers, or the workers do not fit."""
        ray = _import_ray()
        address = os.environ.get("RAY_ADDRESS") or "auto"
        if address.startswith("ray://"):
            raise ValueError(f"RAY_ADDRESS {address} is a Ray Client address: run `conveyor "
                             f"serve` on a node of the cluster, with RAY_ADDRESS=HOST:PORT of its "
                             f"head (or unset)")
        _probe(address)
        # NOTE: ray.init installs its own SIGTERM handler; the launcher's must stay
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except Exception as e:               # Ray's own kinds vary by release and cause
            raise ValueError(f"cannot join a Ray cluster at {address}: {e}") from None
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
        cluster = cls(ray)
        try:
            cluster._place(engine, timeout_s)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _place(self, engine: EngineConfig, timeout_s: float) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        deadline = time.monotonic() + timeout_s
        tp, pp, dp = (engine.tensor_parallel_size, engine.pipeline_parallel_size,
                      engine.data_parallel_size)
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        gpu = (engine.device == "cuda" or engine.device == "auto"
               and any(n.get("GPU", 0) for n in nodes))
        kind = "GPU" if gpu else "CPU"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        need = dp * tp * pp
        shape = " x ".join(f"{name} {n}" for name, n in (("data parallel", dp),
                           ("pipeline parallel", pp), ("tensor parallel", tp)) if n > 1) or "1"
        nodes = self._await_nodes(kind, need, deadline, f"{shape} needs {need} workers of "
                                                        f"{bundle}")
        groups = layout([n.get(kind, 0) for n in nodes], tp, pp)
        for _ in range(dp):
            slots = []                       # (group, bundle index) by rank
            for strategy, size in groups:
                group = placement_group([dict(bundle)] * size, strategy=strategy)
                self.groups.append(group)
                slots += [(group, i) for i in range(size)]
            for group in {id(g): g for g, _ in slots}.values():
                try:
                    ray.get(group.ready(), timeout=max(0.1, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    raise ValueError(
                        f"Ray could not place {shape} ({need} workers of {bundle}, "
                        f"{' + '.join(f'{s} {n}' for s, n in groups)} per replica) within "
                        f"{timeout_s:.0f} s; the nodes hold {[n.get(kind, 0) for n in nodes]} "
                        f"{kind}") from None
            host = ray.remote(WorkerHost)
            actors = [host.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
                for group, i in slots]
            self.actors.append(actors)
            try:
                self.where.append(ray.get([a.where.remote() for a in actors],
                                          timeout=max(1.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                raise ValueError(f"the Ray worker actors did not start within {timeout_s:.0f} s"
                                 ) from None

    def _await_nodes(self, kind: str, need: int, deadline: float, what: str) -> list[dict]:
        """The live nodes' resources, once they hold `need` of `kind` in all (nodes may still
        be joining: a Kubernetes worker pod starts after the head); ValueError at the
        deadline."""
        told = time.monotonic()
        while True:
            nodes = [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]
            have = sum(n.get(kind, 0) for n in nodes)
            if have >= need:
                return nodes
            line = f"the Ray cluster has {have:g} {kind} over {len(nodes)} node(s); {what}"
            if time.monotonic() >= deadline:
                raise ValueError(f"{line}: add nodes, or lower the parallel sizes")
            if time.monotonic() - told >= NODES_NOTE_EVERY_S:
                print(f"conveyor: waiting for Ray nodes: {line}", flush=True)
                told = time.monotonic()
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def links(self) -> TcpLinks:
        """The TCP links of this launch: on this host's address, a port per worker link and
        per replica's results, one for the launcher's control; each replica's rendezvous."""
        dp = len(self.actors)
        names = ["control"]
        for replica, actors in enumerate(self.actors):
            names.append(results_name(replica, dp))
            names += [worker_name(replica, rank, dp) for rank in range(len(actors))]
        rendezvous = tuple(f"tcp://{_host(w[0]['ip'])}:{w[0]['port']}" for w in self.where)
        return TcpLinks.draw(self.ray.util.get_node_ip_address(), names, rendezvous)

    def describe(self) -> str:
        """Where each worker runs, for the start-up log."""
        dp = len(self.actors)
        return "; ".join(f"{worker_name(replica, rank, dp)} on {w['ip']} (node "
                         f"{w['node_id'][:8]}, pid {w['pid']})"
                         for replica, where in enumerate(self.where)
                         for rank, w in enumerate(where))

    def start(self, cfg: ServeConfig) -> dict[str, RayWorker]:
        """Run every worker main; the workers by name, as child processes."""
        dp = len(self.actors)
        workers = {}
        for replica, actors in enumerate(self.actors):
            for rank, actor in enumerate(actors):
                name = worker_name(replica, rank, dp)
                workers[name] = RayWorker(self.ray, actor, self.where[replica][rank])
                workers[name].start(name, cfg, rank, replica)
        self.workers = workers
        return workers

    def close(self) -> None:
        """Stop the actors, free the placement groups, leave the cluster."""
        from ray.util.placement_group import remove_placement_group

        for actor in (a for actors in self.actors for a in actors):
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:                # already gone
                pass
        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:
                pass
        self.ray.shutdown()
        for worker in self.workers.values():
            os.close(worker.sentinel)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
