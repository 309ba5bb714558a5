"""A worker process: rank r of a replica's PP x TP ranks, one model shard and its KV pool.

Rank r is tensor-parallel rank r % TP of pipeline stage r // TP (shared/parallel.py). Every rank
pulls every StepPlan and hands it to its executor (the layers all-reduce within a stage, stages
pass activations on); the sampling rank (rank 0 without pipeline parallelism, else the last
stage's first) also tells the scheduler the KV pool size at start (the minimum over ranks) and
pushes each StepResult. This is the worker end of the scheduler's executor: the step loop itself
is EngineCore's (conveyor/engine.py).
"""
from __future__ import annotations

import os

import zmq

from conveyor.engine import max_model_len
from conveyor.shared import links
from conveyor.shared.config import ServeConfig
from conveyor.shared.messages.control import Ready, Shutdown
from conveyor.shared.messages.worker import StepPlan
from conveyor.shared.model_files import engine_model
from conveyor.shared.parallel import reporting_rank
from conveyor.shared.process import StartupError
from conveyor.shared.replicas import results_name, worker_name
from conveyor.shared.sockets import Socket

_POLL_MS = 1     # while a step runs on the device: how often to look whether it is done


def worker_main(ctx: zmq.Context, control: Socket, cfg: ServeConfig, rank: int,
                replica: int = 0) -> None:
    import torch
    import torch.distributed as dist

    from conveyor.worker.executor import LocalExecutor
    from conveyor.worker.model_runner import ModelRunner
    from conveyor.worker.profiling import StepProfiler, host_phase

    engine = cfg.engine.with_defaults(offline=False)   # "auto": decided where torch is
    tp, pp, dp = (engine.tensor_parallel_size, engine.pipeline_parallel_size,
                  engine.data_parallel_size)
    world = engine.world_size
    on_ray = engine.distributed_executor_backend == "ray"
    if engine.device == "cuda":
        # replica r holds GPUs r*world .. r*world+world-1; a Ray actor sees only its own GPU
        index = 0 if on_ray else replica * world + rank
        if index >= torch.cuda.device_count():
            raise StartupError(f"--data-parallel-size {dp} x --pipeline-parallel-size {pp} x "
                               f"--tensor-parallel-size {tp} needs {dp * world} GPUs; "
                               f"{torch.cuda.device_count()} are visible")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if not on_ray:                       # Ray sets OMP_NUM_THREADS to the actor's CPUs
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (world * dp)))
    if world > 1:
        if cfg.links is None:
            # NOTE: a tcp:// rendezvous listens on every interface whatever host it is given; a
            # file in the private runtime folder does not listen at all, and the collectives'
            # own sockets stay on loopback (all ranks are on this host)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            init_method = f"file://{cfg.runtime_dir}/distributed-{replica}"
        else:                                # ranks on several hosts: rank 0's node listens
            init_method = cfg.links.rendezvous[replica]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=init_method,
                                rank=rank, world_size=world,
                                device_id=device if device.type == "cuda" else None)
        if pp > 1:
            from conveyor.worker.layers.pipeline import join_pipeline

            join_pipeline(rank, tp, pp)
        if device.type == "cuda" and tp > 1 and not engine.disable_custom_all_reduce:
            from conveyor.worker.layers.parallel import enable_custom_all_reduce

            enable_custom_all_reduce(device)
    files, model = engine_model(engine)
    profiler = StepProfiler.from_env(rank, device.type == "cuda")
    runner = ModelRunner(engine, model, files, max_model_len(engine, model), device)
    # NOTE: a pipeline stage runs each plan to its end: overlapping a plan with the next would
    # hold a result back until the next plan's activations arrived. Nor does a CPU worker
    # overlap: its step computes inside submit, so a result held until the next submit would
    # wait for the next step's whole forward pass (a step's time more on every token); the
    # scheduler still plans the next step while this one computes (another process).
    executor = LocalExecutor(runner, engine.async_scheduling and pp == 1
                             and device.type == "cuda")
    plans = links.connect(ctx, zmq.PULL, cfg, worker_name(replica, rank, dp),
                          allowed=(StepPlan, Shutdown))
    results = None
    if rank == reporting_rank(tp, pp):
        results = links.connect(ctx, zmq.PUSH, cfg, results_name(replica, dp))
        results.send(Ready("worker", {"num_blocks": runner.num_blocks,
                                      "device": device.type}))
    control.send(Ready(worker_name(replica, rank, dp), runner.describe()))
    while True:
        with host_phase(profiler, "conveyor: wait for a plan"):
            plan_first = _plan_comes_first(plans, runner)
        if not plan_first:                   # its step is done and no plan came first
            _send(results, [executor.result(wait=True)])
            continue
        with host_phase(profiler, "conveyor: receive a plan"):
            _, plan = plans.recv()
        if isinstance(plan, Shutdown):
            if profiler is not None:
                profiler.finish()
            return
        if not isinstance(plan, StepPlan):
            raise RuntimeError(f"unreadable step plan from the scheduler: {plan.error}")
        if profiler is not None:
            profiler.before_step()
        with host_phase(profiler, "conveyor: run a step"):
            executor.submit(plan)            # the previous step's result is ready behind it
        _send(results, executor.ready)
        executor.ready.clear()


def _plan_comes_first(plans: Socket, runner) -> bool:
    """Wait until a plan arrives (True) or the step in flight is done on the device (False: its
    result goes out without waiting for the next plan, which may wait for that result).

    NOTE: ranks may decide differently here; that is safe because taking a result makes no
    collective call (those are in submit, in plan order on every rank).
    """
    if not runner.in_flight:
        return True
    while not plans.sock.poll(0):
        if runner.step_done():
            return False
        plans.sock.poll(_POLL_MS)            # returns at once when a plan comes
    return True


def _send(results: Socket | None, outgoing) -> None:
    for result in outgoing:
        if results is not None and result is not None:
            results.send(result)
