"""What every HTTP request passes before the API sees it: API keys, rate limit, body cap.

`Guard` is plain ASGI middleware. The probes (/health, /ping, /version and /metrics, unless
--metrics-need-api-key) answer without a key, as vLLM's do; every other path needs it, unknown ones
included (so a client without the key learns no route). Keys are compared as SHA-256 digests with
`hmac.compare_digest` against every configured key, so neither the key's content nor its length
shows in the timing. The rate limit is a token bucket per API key (per client address when no
keys are set), shared by every frontend (rate_limit.py); a refusal says when to retry
(Retry-After). A body over the cap is refused with 413 whether or not it declares its length (an
undeclared one as it is read, through the app's HTTPException handler). Every response's status
is counted for the metrics under its route.

Below the ASGI layer, `read_deadline_protocol` gives each request a deadline to arrive whole
(headers and body), so clients that trickle bytes (slowloris) cannot hold connections forever,
and caps the size of its headers.
"""
from __future__ import annotations

import hashlib
import hmac
import math

import msgspec
from starlette.exceptions import HTTPException

from conveyor.frontend.rate_limit import SharedBuckets

# answered without an API key (/metrics unless guarded) and never rate limited
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
MAX_HEAD_BYTES = 16 << 10                    # a request's header block, as h11's and Node's
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                    "/health", "/ping", "/metrics", "/version", "/tokenize", "/detokenize",
                    "/tokenizer_info"})
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}


def error_body(status: int, message: str, code: str | int | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error shape; `code` defaults to the status (OpenAI's own codes are strings such
    as "model_not_found"), `param` names the field at fault."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status if code is None else code}}


class Guard:
    def __init__(self, app, api_keys: tuple[str, ...] = (), rate_limit: float | None = None,
                 burst: int = 0, max_body_bytes: int = 8 << 20, metrics=None,
                 buckets_file: str | None = None, metrics_need_api_key: bool = False):
        """buckets_file: where the frontends of one server share their rate-limit buckets."""
        self.app = app
        self.metrics_need_key = metrics_need_api_key
        self.key_digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]
        self.rate = rate_limit
        self.buckets = None if rate_limit is None else SharedBuckets(
            rate_limit, burst or max(1.0, rate_limit), buckets_file)
        self.max_body = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 0

        async def counted_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._check(scope, path)
            if refusal is not None:
                await _send_error(counted_send, *refusal)
                return
            received = 0

            async def capped_receive():
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_body:       # the app answers it with a 413
                        raise HTTPException(*self._too_large())
                return message

            await self.app(scope, capped_receive, counted_send)
        finally:
            if self.metrics is not None:
                self.metrics.http_request(path if path in ROUTES else "other", status or 499)

    def _check(self, scope, path: str) -> tuple | None:
        """(status, message[, extra headers]) if the request is refused here."""
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return self._too_large()
        key = ""
        if self.key_digests and self._needs_key(path):
            key = _bearer(headers.get(b"authorization", b""))
            digest = hashlib.sha256(key.encode(errors="replace")).digest()
            match = -1
            for i, known in enumerate(self.key_digests):   # NOTE: no early exit: all compared
                if hmac.compare_digest(digest, known):
                    match = i
            if match < 0:
                return 401, "a valid API key is required (Authorization: Bearer KEY)"
            scope.setdefault("state", {})["api_key_index"] = match    # the tenant
        if self.buckets is not None and path not in OPEN_PATHS:
            client = f"key:{key}" if key else f"address:{(scope.get('client') or ('?',))[0]}"
            wait = self.buckets.take(client)
            if wait > 0:
                per = "API key" if self.key_digests else "client address"
                unit = "request" if self.rate == 1 else "requests"
                retry = max(1, math.ceil(wait))
                return (429, f"rate limit exceeded: {self.rate:g} {unit} per second per {per}; "
                             f"retry in {retry} s", [(b"retry-after", str(retry).encode())])
        return None

    def _needs_key(self, path: str) -> bool:
        return path not in OPEN_PATHS or (path == "/metrics" and self.metrics_need_key)

    def _too_large(self) -> tuple[int, str]:
        return 413, f"the request body exceeds {self.max_body} bytes"


def _bearer(value: bytes) -> str:
    scheme, _, token = value.decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def _send_error(send, status: int, message: str, headers: list | None = None) -> None:
    body = msgspec.json.encode(error_body(status, message))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def read_deadline_protocol(timeout_s: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type:
    """uvicorn's httptools protocol, closing a connection whose request (headers and body) is
    not all in within timeout_s of its first byte (or of the connection, for the first request),
    and answering 431 to a header block still incomplete past max_head_bytes.

    NOTE: uvicorn's own timeouts cover only an idle keep-alive connection; nothing bounds the
    time a request takes to arrive, nor (with httptools) the size of its headers.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class ReadDeadline(HttpToolsProtocol):
        _deadline = None
        _head_bytes = -1                     # bytes of an incomplete header block; -1: none

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()                  # the first bytes of the next request
            super().data_received(data)
            if self._head_bytes >= 0:
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes and not self.transport.is_closing():
                    self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                         b"content-length: 0\r\nconnection: close\r\n\r\n")
                    self.transport.close()
            if self.cycle is not None and not self.cycle.more_body:
                self._disarm()               # the request is all in

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0

        def on_headers_complete(self) -> None:
            self._head_bytes = -1
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return ReadDeadline
