"""`conveyor serve`: check what can be checked, then start the server and watch it.

Checks what it can before spawning (model files, tensor- and pipeline-parallel splits, the chat
template, the generation config, LoRA modules, the engine port's protection, the HTTP port, which
it keeps reserved so every frontend can share it), makes the private runtime directory, and hands
over to the Supervisor (supervisor.py), which spawns every child with the 'spawn' start method
and watches them until the server stops. Start-up failures print one line.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from conveyor.engine import max_model_len
from conveyor.frontend.tokenizer import read_chat_template
from conveyor.scheduler.policy import make_policy
from conveyor.shared.config import EngineConfig, HttpConfig, ServeConfig
from conveyor.shared.engine_port import secure_engine_port
from conveyor.shared.generation_config import default_sampling
from conveyor.shared.lora import lora_registry
from conveyor.shared.model_config import ModelConfig
from conveyor.shared.model_files import engine_model
from conveyor.shared.parallel import layer_split
from conveyor.shared.sockets import (
    make_runtime_dir,
    remove_runtime_dir,
    remove_stale_runtime_dirs,
    reserve_shared_port,
)
from conveyor.supervisor import LaunchError, Supervisor

__all__ = ["LaunchError", "serve"]


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if heads % tp:
        raise LaunchError(f"--tp {tp} does not divide the model's {heads} attention heads")
    if kv % tp and tp % kv:
        raise LaunchError(f"--tp {tp} neither divides the model's {kv} KV heads nor is a "
                          f"multiple of them")


def check_pipeline_parallel(model: ModelConfig, pp: int) -> list[range]:
    """Each stage's layers; a stage without one is refused."""
    try:
        return layer_split(model.num_hidden_layers, pp)
    except ValueError as e:
        raise LaunchError(f"--pipeline-parallel-size {pp}: {e}") from None


def default_frontends() -> int:
    """One frontend process per 4 cores this process may use, 1 to 8: a frontend's event loop
    (HTTP, detokenizing, streaming) takes one core at its busiest, and the scheduler, the
    workers and the clients of a benchmark on the same host need theirs."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 4))


def model_parsers(model: ModelConfig, http: HttpConfig) -> HttpConfig:
    """The HTTP config with the parsers the model's output format needs where none was given:
    gpt-oss writes harmony channels, whose markers (special tokens) would otherwise be dropped
    and its thought run into its answer; vLLM reads them for gpt-oss without a flag too."""
    if model.architecture != "GptOssForCausalLM" or http.reasoning_parser is not None:
        return http
    print("conveyor: gpt-oss: reading its harmony channels (--reasoning-parser openai_gptoss)",
          flush=True)
    return dataclasses.replace(http, reasoning_parser="openai_gptoss")


def serve(engine: EngineConfig, http: HttpConfig, *, host: str = "127.0.0.1", zmq_port: int = 0,
          num_frontends: int | None = None, curve_keys: str | None = None,
          startup_timeout: float = 600.0, skip_tokenizer_init: bool = False,
          zmq_host: str = "127.0.0.1") -> int:
    """Run `conveyor serve` until it stops; returns the exit code. What the engine leaves to
    choose (device "auto", the token budget) is chosen by EngineConfig.with_defaults in the
    workers, which import torch anyway, and in the scheduler from worker 0's device: this
    long-lived process never imports torch."""
    # NOTE: runtime adapter loading keeps one table of adapters: one frontend
    num_frontends = num_frontends or (1 if engine.allow_runtime_lora_updating
                                      else default_frontends())
    files, model = engine_model(engine)
    try:
        http = model_parsers(model, http)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    check_tensor_parallel(model, engine.tensor_parallel_size)
    stages = check_pipeline_parallel(model, engine.pipeline_parallel_size)
    max_model_len(engine, model)
    try:
        make_policy(engine.scheduling_policy)    # the scheduler process loads it again
        # the frontends read these again; a bad one fails here, before anything starts
        if engine.chat_template is not None:
            read_chat_template(engine.chat_template)
        defaults = default_sampling(files, engine.generation_config)
        lora_registry(engine, model)             # --lora-modules checked before anything starts
    except ValueError as e:
        raise LaunchError(str(e)) from None
    try:
        curve_keys, note = secure_engine_port(zmq_host, curve_keys)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if note is not None:
        print(f"conveyor: {note}", flush=True)
    if defaults:
        print(f"conveyor: default sampling from the model's generation_config.json: "
              f"{', '.join(f'{k}={v}' for k, v in defaults.items())} (requests override it; "
              f"--generation-config vllm turns it off)", flush=True)
    reserved = None
    if http.port is not None:
        if http.ssl_certfile:
            import ssl

            try:    # the key and certificate read now, so a bad pair stops the launch here
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    http.ssl_certfile, http.ssl_keyfile)
            except (OSError, ssl.SSLError) as e:
                raise LaunchError(f"cannot serve HTTPS with --ssl-certfile {http.ssl_certfile} "
                                  f"and --ssl-keyfile {http.ssl_keyfile}: {e}") from None
        try:
            reserved = reserve_shared_port(host, http.port)   # held until exit
        except OSError as e:
            raise LaunchError(f"cannot listen on {http.scheme}://{host}:{http.port}: {e}") from None
        http = dataclasses.replace(http, port=reserved.getsockname()[1])
    remove_stale_runtime_dirs()
    runtime_dir = make_runtime_dir()
    try:
        if reserved is not None:
            from conveyor.frontend.metrics import setup_multiprocess_dir
            setup_multiprocess_dir(Path(runtime_dir) / "metrics")
        cfg = ServeConfig(engine, str(runtime_dir), os.getpid(), host, zmq_port, num_frontends,
                          curve_keys, http, skip_tokenizer_init, zmq_host)
        if len(stages) > 1:
            print(f"conveyor: pipeline stages' layers: "
                  f"{', '.join(f'{r.start}-{r.stop - 1}' for r in stages)}", flush=True)
        return Supervisor(cfg).run(startup_timeout)
    finally:
        remove_runtime_dir(runtime_dir)
        if reserved is not None:
            reserved.close()
