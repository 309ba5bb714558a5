"""A frontend process: the public endpoints of the engine, on one asyncio loop.

It serves the ZMQ client protocol (docs/PROTOCOL.md) on a ROUTER at tcp://zmq_host:zmq_port+index
(conveyor/frontend/zmq_endpoint.py) and the OpenAI HTTP API (conveyor/frontend/routes.py) on the
port every frontend shares. Both hand requests to one FrontendCore, which talks to the
scheduler, or with --data-parallel-size N to N schedulers through a Router (router.py). The
launcher drives its state over the control socket: Ready (all processes are up: serve), Drain
(SIGTERM: refuse new requests, finish open ones, then report Drained), EngineDead (fail every
open request), ReplicaDead (fail that replica's requests), Shutdown (exit).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import uvloop
import zmq
import zmq.asyncio

from conveyor.engine import max_model_len
from conveyor.frontend.core import DEAD, DRAINING, READY, FrontendCore
from conveyor.frontend.reasoning import REASONING_PARSERS
from conveyor.frontend.router import Router
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.frontend.zmq_endpoint import ZmqEndpoint
from conveyor.shared.config import ServeConfig
from conveyor.shared.generation_config import default_sampling
from conveyor.shared.lora import lora_registry
from conveyor.shared.messages.client import CancelRequest, GenerateRequest
from conveyor.shared.messages.control import (
    Drain,
    Drained,
    EngineDead,
    Ready,
    ReplicaDead,
    Shutdown,
)
from conveyor.shared.messages.engine import Stats, StatsRequest, TokenOutputs
from conveyor.shared.model_files import (
    DEFAULT_MODEL_NAME,
    engine_model,
)
from conveyor.shared.process import StartupError
from conveyor.shared.replicas import scheduler_name
from conveyor.shared.sockets import (
    Socket,
    authorized_clients,
    ipc,
    load_curve_keys,
    tcp_listener,
)

log = logging.getLogger(__name__)
_DRAIN_POLL_S = 0.05
_FLUSH_S = 2.0     # how long ended HTTP responses get to write their last bytes


def frontend_main(ctx: zmq.Context, control: Socket, cfg: ServeConfig, index: int) -> None:
    e = cfg.engine
    files, model = engine_model(e)
    tokenizer = None if cfg.skip_tokenizer_init else load_tokenizer(
        files, e.tokenizer, e.chat_template, e.revision)
    metrics = None
    if cfg.http.port is not None:
        from conveyor.frontend.metrics import ServerMetrics
        metrics = ServerMetrics(served_names(cfg)[0], launcher_pid=cfg.launcher_pid)
    # NOTE: the caps are per server; each of the F frontends enforces its share
    share = cfg.http.max_concurrent_requests
    core = FrontendCore(tokenizer, model.vocab_size, max_model_len(cfg.engine, model),
                        f"f{index}-", lambda msg: None,
                        None if share is None else -(-share // cfg.num_frontends),
                        cfg.http.request_timeout, metrics, cfg.http.max_n,
                        loras=lora_registry(cfg.engine, model, served_names(cfg)),
                        reasoning=REASONING_PARSERS.get(cfg.http.reasoning_parser))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(Frontend(cfg, index, core, metrics,
                            default_sampling(files, e.generation_config)).run(ctx, control))


def served_names(cfg: ServeConfig) -> tuple[str, ...]:
    """The model names clients may use; the first names the model in responses and metrics."""
    return cfg.http.served_model_names or (cfg.engine.model or DEFAULT_MODEL_NAME,)


class Frontend:
    def __init__(self, cfg: ServeConfig, index: int, core: FrontendCore, metrics,
                 defaults: dict | None = None):
        self.cfg, self.index, self.core, self.metrics = cfg, index, core, metrics
        self.defaults = defaults or {}               # sampling defaults of requests
        self.role = f"frontend-{index}"
        self._http = None                    # the uvicorn server, if HTTP is on
        self.router: Router | None = None    # with --data-parallel-size > 1

    async def run(self, ctx: zmq.Context, control: Socket) -> None:
        actx = zmq.asyncio.Context.shadow(ctx.underlying)
        cfg = self.cfg
        curve = load_curve_keys(cfg.zmq_curve_keys) if cfg.zmq_curve_keys else None
        auth = None
        clients = authorized_clients(cfg.zmq_curve_keys) if curve else None
        if clients is not None:      # a ZAP handler on this context, before any handshake
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(ctx, log=logging.getLogger("conveyor.zap"))
            auth.start()
            auth.configure_curve(domain="*", location=str(clients))
        address = f"tcp://{cfg.zmq_host}:{cfg.zmq_port + self.index if cfg.zmq_port else '*'}"
        try:
            self.clients = Socket(actx, zmq.ROUTER, address, bind=True,
                                  allowed=(GenerateRequest, CancelRequest, StatsRequest),
                                  curve_keys=curve)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot listen on {address}: {e}") from None
        dp = cfg.engine.data_parallel_size
        schedulers = [Socket(actx, zmq.DEALER, ipc(cfg.runtime_dir, scheduler_name(r, dp)),
                             bind=False, identity=self.role.encode(), allowed=(TokenOutputs, Stats))
                      for r in range(dp)]
        commands = Socket(actx, zmq.PULL, ipc(cfg.runtime_dir, self.role), bind=True,
                          allowed=(Ready, Drain, EngineDead, ReplicaDead, Shutdown))
        self.control = control
        # NOTE: these run as long as the process serves; one that ends takes the process down
        tasks = [asyncio.ensure_future(ZmqEndpoint(self.clients, self.core).serve())]
        if dp == 1:
            self.core.send = schedulers[0].send
            tasks.append(asyncio.ensure_future(self._pump(schedulers[0], self._on_scheduler)))
        else:
            self.router = Router([s.send for s in schedulers], cfg.engine.dp_routing_policy,
                                 cfg.engine.block_size, self.core.on_outputs, self.core.on_stats)
            self.core.send = self.router.send
            tasks += [asyncio.ensure_future(self._pump(
                sock, lambda _, msg, r=r: self.router.on_message(r, msg)))
                for r, sock in enumerate(schedulers)]
        info = {"address": self.clients.address}
        if cfg.http.port is not None:
            tasks.append(await self._start_http())
            info["http"] = f"{cfg.http.scheme}://{cfg.host}:{cfg.http.port}"
        control.send(Ready(self.role, info))
        try:
            while True:
                _, msg = await _first(commands.recv_async(), tasks)
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, Ready):
                    if self.core.state not in (DRAINING, DEAD):
                        self.core.state = READY
                    control.send(Ready(self.role, {}))
                elif isinstance(msg, Drain):
                    self._draining = asyncio.ensure_future(self._drain(msg.timeout_s))
                elif isinstance(msg, ReplicaDead):
                    self.router.replica_dead(msg.replica, msg.reason)
                elif isinstance(msg, EngineDead):
                    self.core.state = DEAD
                    self.core.fail_all(msg.reason, 503)
                    self._draining = asyncio.ensure_future(self._drained())
        finally:
            for task in tasks:
                task.cancel()
            self.core.state = DEAD
            self.core.fail_all("the server is shutting down", 503)
            self.clients.close(linger_ms=2000)
            if auth is not None:
                auth.stop()

    async def _pump(self, socket: Socket, handle) -> None:
        while True:
            handle(*await socket.recv_async())

    async def _drain(self, timeout_s: float) -> None:
        if self.core.state == READY:
            self.core.state = DRAINING
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.core.open and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        self.core.fail_all(f"the server is shutting down: the request did not finish within "
                           f"the shutdown timeout ({timeout_s:g} s)", 503)
        await self._drained()

    async def _drained(self) -> None:
        """Tell the launcher once the HTTP responses in progress have written their last bytes
        (their requests have all ended), so that stopping this process cuts no stream short."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _FLUSH_S
        while self._http is not None and self._http.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        self.control.send(Drained(self.role))

    async def _start_http(self) -> asyncio.Task:
        """uvicorn serving the API, once it listens (a failure to start raises here)."""
        import uvicorn

        from conveyor.frontend.guard import Guard, read_deadline_protocol
        from conveyor.frontend.routes import build_app

        h = self.cfg.http
        app = Guard(build_app(self.core, served_names(self.cfg), h.max_n, self.metrics,
                              h.cache_salt_per_api_key, self.defaults,
                              h.tool_call_parser if h.enable_auto_tool_choice else None,
                              h.reasoning_parser, self.cfg.engine.allow_runtime_lora_updating,
                              self.router),
                    h.api_keys, h.rate_limit, h.rate_limit_burst, h.max_body_bytes, self.metrics,
                    buckets_file=str(Path(self.cfg.runtime_dir) / "rate-limit"),
                    metrics_need_api_key=h.metrics_need_api_key)
        if h.allowed_origins:
            from starlette.middleware.cors import CORSMiddleware

            # NOTE: outside the guard, so a browser's preflight (OPTIONS, which carries no key)
            # is answered; the request itself still needs the key
            app = CORSMiddleware(app, allow_origins=list(h.allowed_origins),
                                 allow_methods=["*"], allow_headers=["*"])
        sock = tcp_listener(self.cfg.host, h.port)
        config = uvicorn.Config(app, http=read_deadline_protocol(h.read_timeout),
                                lifespan="off", log_level=h.uvicorn_log_level,
                                access_log=h.uvicorn_log_level in ("info", "debug", "trace"),
                                timeout_keep_alive=30, ssl_keyfile=h.ssl_keyfile,
                                ssl_certfile=h.ssl_certfile)
        server = self._http = _uvicorn_server(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()
                raise StartupError(f"the HTTP server on port {h.port} did not start")
            await asyncio.sleep(0.01)
        return task

    # --- scheduler ----------------------------------------------------------------------------

    def _on_scheduler(self, peer, msg) -> None:
        if isinstance(msg, Stats):
            self.core.on_stats(msg)
        elif isinstance(msg, TokenOutputs):
            self.core.on_outputs(msg.outputs)
        else:
            raise RuntimeError(f"unreadable message from the scheduler: {msg}")


async def _first(awaitable, tasks: list[asyncio.Task]):
    """The awaitable's result; raises if one of `tasks` ends first (they should never end)."""
    wanted = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait([wanted, *tasks], return_when=asyncio.FIRST_COMPLETED)
    if wanted in done:
        return wanted.result()
    wanted.cancel()
    ended = next(iter(done))
    ended.result()                               # its exception, if it raised one
    raise RuntimeError(f"a frontend task stopped: {ended}")


def _uvicorn_server(config):
    """uvicorn's server without its signal handlers: the launcher owns this process's life."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(config)
