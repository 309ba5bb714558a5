"""The OpenAI-compatible HTTP API of a frontend process (FastAPI on uvicorn): its routes.

POST /v1/completions, /v1/chat/completions, /v1/responses (streamed as server-sent events when
asked),
/tokenize, /detokenize; GET /v1/models, /tokenizer_info, /health, /ping (also POST), /metrics,
/version; with --allow-runtime-lora-updating POST /v1/load_lora_adapter and
/v1/unload_lora_adapter. A request runs with a LoRA adapter by naming it as its `model`. Every
frontend process
serves this app on one shared port, behind `Guard` (auth, rate limit, body cap). Errors are
OpenAI's error JSON with the right status. The generation routes turn a request into
GenerateRequests for the FrontendCore; http.py sends back what it delivers.
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
from conveyor.frontend.chat_output import ChatReader
from conveyor.frontend.core import READY, FrontendCore
from conveyor.frontend.http import ApiError, Run, error_response
from conveyor.frontend.openai_responses import ChatShape, CompletionShape
from conveyor.frontend.reasoning import REASONING_PARSERS
from conveyor.frontend.responses_api import ResponsesRequest, ResponsesShape, chat_request
from conveyor.frontend.tokenizer import apply_chat_template, check_token_ids, template_reads
from conveyor.frontend.tools import constrain, tool_mode
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.request_options import RequestOptions

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 2.0


@contextlib.contextmanager
def _bad_request():
    """A ValueError inside is the client's mistake: a 400 saying what is wrong."""
    try:
        yield
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _decode(body: bytes, kind: type):
    with _bad_request():
        return oai.decode_request(body, kind)


class _TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[oai.ChatMessage] | None = None
    add_special_tokens: bool = True
    # a chat's prompt as the chat route makes it (vLLM's fields)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    return_token_strs: bool = False


def template_kwargs(req: oai.ChatRequest | _TokenizeRequest) -> dict:
    """The chat template's variables a request sets beyond its messages and tools:
    add_generation_prompt and continue_final_message where not left as they are, then
    chat_template_kwargs; ValueError for a combination that cannot hold."""
    out = {}
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if not req.messages or req.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the "
                             "assistant's")
        out["continue_final_message"] = True
    if not req.add_generation_prompt:
        out["add_generation_prompt"] = False
    return {**out, **(req.chat_template_kwargs or {})}


class _DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


class _LoadLoRA(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class _UnloadLoRA(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None


class Routes:
    def __init__(self, core: FrontendCore, model_names: tuple[str, ...], max_n: int,
                 metrics=None, salt_per_key: bool = False, defaults: dict | None = None,
                 tool_parser: str | None = None, reasoning_parser: str | None = None,
                 replicas=None):
        self.core, self.model_names, self.max_n = core, model_names, max_n
        self.replicas = replicas             # the data-parallel Router, or None (one replica)
        self.metrics, self.salt_per_key = metrics, salt_per_key
        self.defaults = defaults or {}       # sampling defaults (the model's generation config)
        self.tool_parser = tool_parser       # set only with --enable-auto-tool-choice
        self.reasoning = None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser]
        self.created = int(time.time())

    def check_model(self, name: str | None) -> str:
        """The model a request names: the base (one of its names) or a LoRA adapter."""
        loras = self.core.loras.adapters if self.core.loras is not None else {}
        if name is not None and name not in self.model_names and name not in loras:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join([*self.model_names, *loras])}", "model_not_found",
                           "model")
        return name or self.model_names[0]

    def options(self, request: Request, req, model: str | None = None) -> RequestOptions:
        """The request's RequestOptions (the body has each of its fields at the top level, and
        names a LoRA adapter as its model); with salt_per_key, its cache salt is inside its API
        key's own namespace."""
        given = {name: getattr(req, name) for name in RequestOptions.__struct_fields__
                 if name != "lora"}
        if model is not None and model not in self.model_names:
            given["lora"] = model
        if self.salt_per_key:
            tenant = request.scope.get("state", {}).get("api_key_index", "none")
            salt = given["cache_salt"]
            given["cache_salt"] = f"key-{tenant}" + ("" if salt is None else f"/{salt}")
        return RequestOptions(**given)

    async def parse(self, request: Request, kind: type):
        req = _decode(await request.body(), kind)
        if self.core.state != READY:
            raise ApiError(503, f"the server is {self.core.state}")
        return req, self.check_model(req.model)

    async def completions(self, request: Request):
        req, model = await self.parse(request, oai.CompletionRequest)
        with _bad_request():
            params = oai.sampling_params(req, self.defaults)
            prompts = oai.completion_prompts(req)
            if len(prompts) * params.n > self.max_n:
                raise ValueError(f"n times the number of prompts must be at most {self.max_n} "
                                 f"(--max-n), got {params.n} x {len(prompts)}")
            options = self.options(request, req, model)
        gens = [GenerateRequest(id=str(i), sampling=params, stream=req.stream, options=options,
                                add_special_tokens=req.add_special_tokens,
                                **({"prompt": p} if isinstance(p, str) else
                                   {"prompt_token_ids": p})) for i, p in enumerate(prompts)]
        shape = CompletionShape(f"cmpl-{_response_id(req)}", model, req, self.core.tokenizer)
        shape.token_ids = req.return_token_ids or self.core.tokenizer is None
        return await self._respond(request, gens, shape, req)

    async def chat_completions(self, request: Request):
        req, model = await self.parse(request, oai.ChatRequest)
        gen, reader = self._chat(request, req, model)
        shape = ChatShape(f"chatcmpl-{_response_id(req)}", model, req.n,
                          req.top_logprobs or 0, req.prompt_logprobs, reader)
        shape.token_ids = req.return_token_ids
        last = gen.messages[-1]
        if req.echo and last["role"] == "assistant":
            shape.echo = last["content"]
        return await self._respond(request, [gen], shape, req)

    async def responses(self, request: Request):
        """The Responses API: the chat request it means (responses_api.py), one choice."""
        resp, model = await self.parse(request, ResponsesRequest)
        with _bad_request():
            req = chat_request(resp)
        gen, reader = self._chat(request, req, model)
        return await self._respond(request, [gen], ResponsesShape(resp, model, reader), req)

    def _chat(self, request: Request, req: oai.ChatRequest, model: str):
        """A chat request's GenerateRequest, and what makes a reader of its choices' text
        (None: the text is the content, as it is)."""
        with _bad_request():
            harmony = self.reasoning is not None and self.reasoning.writes_calls
            tools = tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls,
                              self.tool_parser, harmony)
            # NOTE: "required" and named tool choices are held to their call
            params = constrain(oai.sampling_params(req, self.defaults), tools)
            if self.reasoning is not None and self.reasoning.keeps_special_tokens:
                # the reader needs the format's markers; none of them reaches the client
                params = msgspec.structs.replace(params, skip_special_tokens=False)
            # a harmony model is not shown functions it may not call ("none"), as vLLM does:
            # it would call them in its own channels all the same
            shown = None if harmony and tools.choice == "none" else req.tools
            gen = GenerateRequest(id="0", messages=oai.chat_messages(req), tools=shown,
                                  chat_template_kwargs=self._template_kwargs(req),
                                  add_special_tokens=req.add_special_tokens,
                                  sampling=params, stream=req.stream,
                                  options=self.options(request, req, model))
        reads = tools.choice != "none" or self.reasoning is not None
        return gen, (lambda: ChatReader(self.reasoning, tools, req.include_reasoning)) \
            if reads else None

    def _template_kwargs(self, req: oai.ChatRequest) -> dict | None:
        """The chat template's variables: `template_kwargs`, and reasoning_effort where the
        model's template reads it (gpt-oss's); ValueError where it does not."""
        out = template_kwargs(req)
        if req.reasoning_effort is not None:
            if not template_reads(self.core.tokenizer, "reasoning_effort"):
                raise ValueError("reasoning_effort is not supported: this model's chat "
                                 "template does not read it")
            out = {"reasoning_effort": req.reasoning_effort, **out}
        return out or None

    async def _respond(self, request: Request, gens: list[GenerateRequest], shape, req):
        usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's continuous_usage_stats: with include_usage, every chunk carries the counts so far
        shape.continuous_usage = usage and req.stream_options.continuous_usage_stats
        return await Run(self.core, request, gens).respond(shape, req.stream, usage)

    async def models(self):
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "conveyor",
                 "max_model_len": self.core.max_model_len, "root": name, "parent": None}
                for name in self.model_names]
        if self.core.loras is not None:
            data += [{"id": name, "object": "model", "created": self.created,
                      "owned_by": "conveyor", "max_model_len": self.core.max_model_len,
                      "root": lora.lora_path, "parent": self.model_names[0]}
                     for name, lora in self.core.loras.adapters.items()]
        return {"object": "list", "data": data}

    async def load_lora_adapter(self, request: Request):
        req = _decode(await request.body(), _LoadLoRA)
        with _bad_request():
            self.core.loras.add_path(req.lora_name, req.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.",
                        media_type="text/plain")

    async def unload_lora_adapter(self, request: Request):
        req = _decode(await request.body(), _UnloadLoRA)
        lora = self.core.loras.adapters.get(req.lora_name)
        if lora is None or req.lora_int_id not in (None, lora.lora_int_id):
            raise ApiError(404, f"no LoRA adapter {req.lora_name!r} is loaded")
        self.core.loras.remove(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.",
                        media_type="text/plain")

    async def health(self):
        if self.core.state != READY:
            return error_response(503, f"the server is {self.core.state}")
        if self.replicas is None:
            return Response(status_code=200)
        return {"replicas": [{"replica": r, "status": "dead", "reason": self.replicas.dead[r]}
                             if r in self.replicas.dead else
                             {"replica": r, "status": "ok", "open_sequences": self.replicas.load(r)}
                             for r in range(len(self.replicas.sends))]}

    async def tokenizer_info(self):
        """What a client needs to tokenize as this server does (lm-eval's remote tokenizer)."""
        tok = self._tokenizer(None)
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token,
                "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                "chat_template": tok.chat_template, "model_max_length": self.core.max_model_len}

    async def version(self):
        return {"version": __version__}

    async def prometheus(self):
        if self.metrics is None:
            raise ApiError(404, "metrics are off")
        future = asyncio.get_running_loop().create_future()
        self.core.request_stats(lambda s: future.done() or future.set_result(s))
        try:
            stats = await asyncio.wait_for(future, STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            stats = None
        body, content_type = self.metrics.render(stats)
        return Response(body, media_type=content_type)

    async def tokenize(self, request: Request):
        req = _decode(await request.body(), _TokenizeRequest)
        tokenizer = self._tokenizer(req.model)
        with _bad_request():
            if (req.prompt is None) == (req.messages is None):
                raise ValueError("set exactly one of prompt and messages")
            if req.messages is not None:
                ids = apply_chat_template(tokenizer, oai.chat_messages(req), tools=req.tools,
                                          **template_kwargs(req))
            else:
                ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": self.core.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, request: Request):
        req = _decode(await request.body(), _DetokenizeRequest)
        tokenizer = self._tokenizer(req.model)
        with _bad_request():
            check_token_ids(req.tokens, self.core.vocab_size)
        return {"prompt": tokenizer.decode(req.tokens)}

    def _tokenizer(self, model: str | None):
        self.check_model(model)
        if self.core.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer")
        return self.core.tokenizer


def build_app(core: FrontendCore, model_names: tuple[str, ...], max_n: int,
              metrics=None, salt_per_key: bool = False, defaults: dict | None = None,
              tool_parser: str | None = None, reasoning_parser: str | None = None,
              runtime_lora_updating: bool = False, replicas=None) -> FastAPI:
    """runtime_lora_updating: serve the adapter load and unload routes (needs core.loras);
    replicas: the data-parallel Router, whose replicas /health lists."""
    app = FastAPI(title="conveyor", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    routes = Routes(core, model_names, max_n, metrics, salt_per_key, defaults, tool_parser,
                    reasoning_parser, replicas)
    for method, path, handler in (
            ("POST", "/v1/completions", routes.completions),
            ("POST", "/v1/chat/completions", routes.chat_completions),
            ("POST", "/v1/responses", routes.responses),
            ("GET", "/v1/models", routes.models), ("GET", "/health", routes.health),
            ("GET", "/ping", routes.health), ("POST", "/ping", routes.health),
            ("GET", "/tokenizer_info", routes.tokenizer_info),
            ("GET", "/version", routes.version), ("GET", "/metrics", routes.prometheus),
            ("POST", "/tokenize", routes.tokenize), ("POST", "/detokenize", routes.detokenize)):
        app.add_api_route(path, handler, methods=[method])
    if runtime_lora_updating and core.loras is not None:
        app.add_api_route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", routes.unload_lora_adapter,
                          methods=["POST"])

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e.status, str(e), e.code, e.param)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(500, "internal server error")

    return app


def _response_id(req) -> str:
    """The id a response carries after its "cmpl-" or "chatcmpl-": the request's own
    request_id (vLLM's), else a fresh one. The engine's ids stay its own, so two requests
    naming the same id do not meet there."""
    rid = req.request_id
    if rid is None:
        return uuid.uuid4().hex
    if not (0 < len(rid) <= 256 and rid.isprintable()):
        raise ApiError(400, "request_id must be 1 to 256 printable characters")
    return rid
