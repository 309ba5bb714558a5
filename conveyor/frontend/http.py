"""The OpenAI-compatible HTTP API of a frontend process (FastAPI on uvicorn).

Routes: POST /v1/completions, /v1/chat/completions (streamed as server-sent events when asked),
/tokenize, /detokenize; GET /v1/models, /health, /metrics, /version. Every frontend process
serves this app on one shared port. `Guard` (auth, rate limit, body cap) wraps the app; errors
are OpenAI's error JSON with the right status. A request's response starts only once the engine
has accepted it, so a refusal is a status code, not a broken stream; a client that disconnects
cancels its request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from conveyor import __version__
from conveyor.frontend import openai_protocol as oai
from conveyor.frontend.core import READY, FrontendCore, RequestError
from conveyor.frontend.guard import error_body
from conveyor.frontend.tokenizer import apply_chat_template, check_token_ids
from conveyor.shared.messages import Completion, GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()
STATS_TIMEOUT_S = 2.0


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def _bad_request():
    """A ValueError inside is the client's mistake: a 400 saying what is wrong."""
    try:
        yield
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def error_response(status: int, message: str) -> Response:
    return Response(_JSON.encode(error_body(status, message)), status,
                    media_type="application/json")


def build_app(core: FrontendCore, model_names: tuple[str, ...], max_n: int,
              metrics=None, salt_per_key: bool = False) -> FastAPI:
    app = FastAPI(title="conveyor", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e.status, str(e))

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(500, "internal server error")

    def check_model(name: str | None) -> str:
        if name is not None and name not in model_names:
            raise ApiError(400, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(model_names)}")
        return name or model_names[0]

    def cache_salt(request: Request, given: str | None) -> str | None:
        """The request's salt; with salt_per_key, inside its API key's own namespace."""
        if not salt_per_key:
            return given
        tenant = request.scope.get("state", {}).get("api_key_index", "none")
        return f"key-{tenant}" + ("" if given is None else f"/{given}")

    async def parse(request: Request, kind: type):
        req = _decode(await request.body(), kind)
        if core.state != READY:
            raise ApiError(503, f"the server is {core.state}")
        return req, check_model(req.model)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, model = await parse(request, oai.CompletionRequest)
        with _bad_request():
            params = oai.sampling_params(req)
            prompts = oai.completion_prompts(req)
            if len(prompts) * params.n > max_n:
                raise ValueError(f"n times the number of prompts must be at most {max_n} "
                                 f"(--max-n), got {params.n} x {len(prompts)}")
        salt = cache_salt(request, req.cache_salt)
        with _bad_request():
            gens = [GenerateRequest(id=str(i), sampling=params, stream=req.stream,
                                    priority=req.priority, cache_salt=salt,
                                    ttft_slo=req.ttft_slo, tpot_slo=req.tpot_slo,
                                    **({"prompt": p} if isinstance(p, str) else
                                       {"prompt_token_ids": p})) for i, p in enumerate(prompts)]
        run = _Run(core, request, gens)
        shape = oai.CompletionShape(f"cmpl-{uuid.uuid4().hex}", model, req, core.tokenizer)
        shape.token_ids = req.return_token_ids or core.tokenizer is None
        return await run.respond(shape, req.stream, req.stream_options)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, model = await parse(request, oai.ChatRequest)
        with _bad_request():
            params = oai.sampling_params(req)
            gen = GenerateRequest(id="0", messages=oai.chat_messages(req), sampling=params,
                                  stream=req.stream, priority=req.priority,
                                  cache_salt=cache_salt(request, req.cache_salt),
                                  ttft_slo=req.ttft_slo, tpot_slo=req.tpot_slo)
        run = _Run(core, request, [gen])
        shape = oai.ChatShape(f"chatcmpl-{uuid.uuid4().hex}", model, req.n, req.top_logprobs or 0)
        shape.token_ids = req.return_token_ids
        return await run.respond(shape, req.stream, req.stream_options)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": created, "owned_by": "conveyor",
                 "max_model_len": core.max_model_len} for name in model_names]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        if core.state != READY:
            return error_response(503, f"the server is {core.state}")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are off")
        future = asyncio.get_running_loop().create_future()
        core.request_stats(lambda s: future.done() or future.set_result(s))
        try:
            stats = await asyncio.wait_for(future, STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            stats = None
        body, content_type = metrics.render(stats)
        return Response(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = _decode(await request.body(), _TokenizeRequest)
        check_model(req.model)
        if core.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer")
        with _bad_request():
            if (req.prompt is None) == (req.messages is None):
                raise ValueError("set exactly one of prompt and messages")
            if req.messages is not None:
                ids = apply_chat_template(core.tokenizer, oai.chat_messages(req),
                                          req.add_generation_prompt)
            else:
                ids = core.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = _decode(await request.body(), _DetokenizeRequest)
        check_model(req.model)
        if core.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer")
        with _bad_request():
            check_token_ids(req.tokens, core.vocab_size)
        return {"prompt": core.tokenizer.decode(req.tokens)}

    return app


class _TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[oai.ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class _DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def _decode(body: bytes, kind: type):
    with _bad_request():
        return oai.decode_request(body, kind)


# --- one generation request -------------------------------------------------------------------

class _Run:
    """The engine requests behind one HTTP request (one per prompt), and its client's fate."""

    def __init__(self, core: FrontendCore, request: Request, gens: list[GenerateRequest]):
        self.core = core
        self.queue: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        self.open: dict[str, str] = {}       # prompt index -> engine request id, until finished
        try:
            for gen in gens:
                self.open[gen.id] = core.submit(gen, self.queue.put_nowait, fit_context=True)
        except RequestError as e:
            self.close()
            raise ApiError(e.code, str(e)) from None
        self.gone = asyncio.ensure_future(_disconnected(request))

    async def next(self) -> list[GenerateOutput] | None:
        """What arrived since the last call (waits for at least one); None if the client left."""
        if self.queue.empty():
            get = asyncio.ensure_future(self.queue.get())
            await asyncio.wait((get, self.gone), return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return None
            items = [get.result()]
        else:
            items = []
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for out in items:
            if out.finished:
                self.open.pop(out.id, None)
        return items

    def close(self) -> None:
        for rid in self.open.values():
            self.core.cancel(rid)
        self.open.clear()
        if hasattr(self, "gone"):
            self.gone.cancel()

    async def respond(self, shape, stream: bool, options: oai.StreamOptions | None) -> Response:
        streaming = False
        try:
            first = await self.next()
            if first is None:
                return Response(status_code=499)     # nobody is listening
            error = _refusal(first)
            if error is not None:
                return error_response(*error)
            if stream:
                streaming = True                     # the stream closes the run when it ends
                return _EventStream(self, shape, first, bool(options and options.include_usage))
            finals = {out.id: out for out in first}
            while self.open:
                items = await self.next()
                if items is None:
                    return Response(status_code=499)
                finals.update((out.id, out) for out in items)
            error = _failure([c for out in finals.values() for c in out.outputs])
            if error is not None:
                return error_response(*error)
            body = shape.whole([finals[k] for k in sorted(finals, key=int)])
            return Response(_JSON.encode(body), media_type="application/json")
        finally:
            if not streaming:
                self.close()


def _refusal(first: list[GenerateOutput]) -> tuple[int, str] | None:
    """An error status if the engine refused the request before producing anything."""
    comps = [c for out in first for c in out.outputs]
    if comps and all(c.error_code and not c.token_ids for c in comps):
        return comps[0].error_code, comps[0].error or "the request failed"
    return None


def _failure(comps: list[Completion]) -> tuple[int, str] | None:
    for c in comps:
        if c.finish_reason == "error":
            return c.error_code or 500, c.error or "the request failed"
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(Response):
    """Server-sent events: one chunk per sample per step, then usage if asked, then [DONE]."""

    def __init__(self, run: _Run, shape, first: list[GenerateOutput], include_usage: bool):
        super().__init__(media_type="text/event-stream")
        self.run, self.shape, self.first, self.include_usage = run, shape, first, include_usage

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"),
                                (b"cache-control", b"no-cache")]})
        run, shape = self.run, self.shape
        try:
            events, items = shape.opening(), self.first
            while True:
                failed = None
                for out in items:
                    shape.prompt_tokens += len(out.prompt_token_ids or [])
                    for c in out.outputs:
                        shape.completion_tokens += len(c.token_ids)
                        events.append(shape.chunk(int(out.id), c))
                    failed = failed or _failure(out.outputs)
                if failed is not None:
                    events.append({"error": error_body(*failed)["error"]})
                    break
                if not run.open:
                    if self.include_usage:
                        events.append(shape.usage_chunk())
                    break
                await send({"type": "http.response.body", "body": _sse(events),
                            "more_body": True})
                events, items = [], await run.next()
                if items is None:
                    return
            await send({"type": "http.response.body", "body": _sse(events) + b"data: [DONE]\n\n",
                        "more_body": False})
        finally:
            run.close()


def _sse(events: list[dict]) -> bytes:
    return b"".join(b"data: " + _JSON.encode(e) + b"\n\n" for e in events)
