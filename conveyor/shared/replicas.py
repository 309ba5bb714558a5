"""Names of the processes and sockets of data-parallel replicas (`--data-parallel-size`).

Replica r is one scheduler and its tensor-parallel workers. With one replica the names are the
plain ones ("scheduler", "worker-0"); with several they carry the replica ("scheduler-1",
"worker-1.0"), so that the launcher, the frontends and the children agree on every ipc:// name.
"""
from __future__ import annotations


def scheduler_name(replica: int, dp: int) -> str:
    return "scheduler" if dp == 1 else f"scheduler-{replica}"


def worker_name(replica: int, rank: int, dp: int) -> str:
    return f"worker-{rank}" if dp == 1 else f"worker-{replica}.{rank}"


def results_name(replica: int, dp: int) -> str:
    """The socket on which rank 0 of a replica pushes StepResults to its scheduler."""
    return "results" if dp == 1 else f"results-{replica}"


def replica_of(role: str) -> int | None:
    """The replica a child belongs to (None: a frontend, not part of any replica)."""
    if role in ("scheduler",) or (role.startswith("worker-") and "." not in role):
        return 0
    if role.startswith("scheduler-"):
        return int(role.removeprefix("scheduler-"))
    if role.startswith("worker-"):
        return int(role.removeprefix("worker-").partition(".")[0])
    return None
