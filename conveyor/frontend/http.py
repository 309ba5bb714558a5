"""The responses of the generation routes: one HTTP request's engine requests and their replies.

A `Run` submits one engine request per prompt to the FrontendCore and collects what it delivers.
A response starts only once the engine has taken the request (its first delivery), so a refusal
is a status code, not a broken stream; a client that disconnects cancels its requests, which
frees their KV blocks. A stream is server-sent events: deltas that arrived together (the engine
ran ahead of this event loop) go out as one chunk per sample, in one write.
"""
from __future__ import annotations

import asyncio

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from conveyor.frontend.core import FrontendCore, RequestError
from conveyor.frontend.guard import error_body
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.shared.messages.client import GenerateRequest

_JSON = msgspec.json.Encoder()


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None) -> Response:
    return Response(_JSON.encode(error_body(status, message, code, param)), status,
                    media_type="application/json")


class Run:
    """The engine requests behind one HTTP request (one per prompt, ids "0", "1", ...)."""

    def __init__(self, core: FrontendCore, request: Request, gens: list[GenerateRequest]):
        self.core = core
        self.items: list[RequestOutput] = []  # delivered, not yet taken by next()
        self.wake: asyncio.Future | None = None
        self.gone = False                     # the client disconnected
        self.open: dict[str, str] = {}        # prompt index -> engine request id, until finished
        self.gens, self.request = gens, request

    async def _submit(self) -> None:
        """Submit every prompt (a long one is tokenized in a thread); ApiError if one is
        refused, and then none stays open."""
        try:
            for gen in self.gens:
                self.open[gen.id] = await self.core.submit_async(gen, self._deliver,
                                                                 fit_context=True)
        except RequestError as e:
            self.close()
            raise ApiError(e.code, str(e)) from None
        self.watch = asyncio.ensure_future(self._watch(self.request))

    def _deliver(self, out: RequestOutput) -> None:
        self.items.append(out)
        if out.finished:
            self.open.pop(out.request_id, None)
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def next(self) -> list[RequestOutput] | None:
        """What was delivered since the last call (waits for something); None if the client
        left."""
        while not self.items:
            if self.gone:
                return None
            self.wake = asyncio.get_running_loop().create_future()
            await self.wake
        items, self.items = self.items, []
        return items

    def close(self) -> None:
        for rid in self.open.values():
            self.core.cancel(rid)
        self.open.clear()
        if hasattr(self, "watch"):
            self.watch.cancel()

    async def respond(self, shape, stream: bool, include_usage: bool) -> Response:
        await self._submit()
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
                return EventStream(self, shape, first, include_usage)
            finals = {out.request_id: out for out in first}
            while self.open:
                items = await self.next()
                if items is None:
                    return Response(status_code=499)
                finals.update((out.request_id, out) for out in items)
            error = _failure([c for out in finals.values() for c in out.outputs])
            if error is not None:
                return error_response(*error)
            body = shape.whole([finals[k] for k in sorted(finals, key=int)])
            return Response(_JSON.encode(body), media_type="application/json")
        finally:
            if not streaming:
                self.close()


def _refusal(first: list[RequestOutput]) -> tuple[int, str] | None:
    """An error status if the engine refused the request before producing anything."""
    comps = [c for out in first for c in out.outputs]
    if comps and all(c.error_code and not c.token_ids for c in comps):
        return comps[0].error_code, comps[0].error or "the request failed"
    return None


def _failure(comps: list[CompletionOutput]) -> tuple[int, str] | None:
    for c in comps:
        if c.finish_reason == "error":
            return c.error_code or 500, c.error or "the request failed"
    return None


def _coalesce(items: list[RequestOutput]) -> list[tuple[int, CompletionOutput]]:
    """(prompt index, delta) per sample with news, consecutive deltas of a sample merged."""
    merged: dict[tuple[int, int], CompletionOutput] = {}
    for out in items:
        for c in out.outputs:
            key = (int(out.request_id), c.index)
            seen = merged.get(key)
            if seen is None:
                merged[key] = c
                continue
            merged[key] = msgspec.structs.replace(
                c, text=seen.text + c.text, token_ids=seen.token_ids + c.token_ids,
                logprobs=None if c.logprobs is None else seen.logprobs + c.logprobs)
    return [(prompt, c) for (prompt, _), c in merged.items()]


class EventStream(Response):
    """Server-sent events: the shape's chunks as deltas come, then its closing ones (usage if
    asked), then [DONE] where the API has it (the Responses API names each event instead)."""

    def __init__(self, run: Run, shape, first: list[RequestOutput], include_usage: bool):
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
                for out in items:
                    shape.saw(int(out.request_id), out)
                failed = _failure([c for out in items for c in out.outputs])
                for prompt, c in _coalesce(items):
                    chunk = shape.chunk(prompt, c)
                    if chunk is not None:            # a parser may hold a piece back
                        events += chunk if isinstance(chunk, list) else [chunk]
                if failed is not None:
                    events += shape.failure(error_body(*failed)["error"])
                    break
                if not run.open:
                    events += shape.closing(self.include_usage)
                    break
                await send({"type": "http.response.body", "more_body": True,
                            "body": _sse(events, shape.sse_event_names)})
                events, items = [], await run.next()
                if items is None:
                    return
            done = b"data: [DONE]\n\n" if shape.done_marker else b""
            await send({"type": "http.response.body", "more_body": False,
                        "body": _sse(events, shape.sse_event_names) + done})
        finally:
            run.close()


def _sse(events: list[dict], named: bool) -> bytes:
    """named: each event's `type` also as its SSE event name."""
    return b"".join([(b"event: " + e["type"].encode() + b"\n" if named else b"")
                     + b"data: " + _JSON.encode(e) + b"\n\n" for e in events])
