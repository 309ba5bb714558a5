"""A fake OpenAI-compatible server for the HTTP benchmark clients' tests (a thread on 127.0.0.1
streaming SSE by hand): benchmarks/serving.py's and benchmarks/client_pool.py's."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams 5 content chunks of 2 tokens each, a usage chunk and [DONE] (unstreamed: one
    answer of 7 tokens); the prompt "fail" gets an error event, "reject" an HTTP 400."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "fake-model"}, {"id": "other"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.received.append((self.path, dict(self.headers), body))
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "reject":
            return self._send(400, {"error": {"message": "bad request", "code": 400}})
        if not body["stream"]:
            usage = {"prompt_tokens": len(prompt), "completion_tokens": 7, "total_tokens": 0}
            return self._send(200, {"choices": [{"index": 0, "text": "abc"}], "usage": usage})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self._write(b": keepalive\n\n")
        if prompt == "fail":
            return self._write(b'data: {"error": {"message": "boom"}}\n\n')
        for _ in range(5):
            time.sleep(0.004)
            choice = {"index": 0, "delta": {"content": "ab"}} if chat else {"index": 0,
                                                                            "text": "ab"}
            event = f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            self._write(event[:9])                                # an event split in two reads
            self._write(event[9:])
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 10, "total_tokens": 0}
        self._write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self._write(b"data: [DONE]\n\n")

    def _write(self, data: bytes):
        self.wfile.write(data)
        self.wfile.flush()

    def _send(self, status: int, obj: dict):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self._write(data)


@contextlib.contextmanager
def fake_openai_server():
    """Serve FakeOpenAI on a free port; yields the server (`.received`: what it was sent)."""
    # NOTE: the default listen backlog (5) drops the SYNs of a burst of connections, which are
    # then retried after 1 s: a first token a second late on an idle server
    httpd = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128})(
        ("127.0.0.1", 0), FakeOpenAI)
    httpd.received = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
