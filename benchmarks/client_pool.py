"""HTTP client processes for the request-path benchmark: the official `openai` package's
AsyncOpenAI, streaming `/v1/completions` with token-id prompts, in N processes so that the
clients' own cost (HTTP, SSE and pydantic parsing of every chunk) is not one core's worth.

Request i goes to process i % N and is sent offsets[i] seconds after a start instant that the
parent gives every process once all are ready (time.monotonic: one clock for all the processes
of a machine), so "all at once" and a Poisson schedule mean the same across processes. Each
process measures its requests as benchmarks/serving.py does (its Result: TTFT to the first
content chunk, gaps between content chunks, output tokens from the final usage chunk) and hands
them back with their times in seconds since the start instant.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass

from benchmarks.serving import Result

START_MARGIN_S = 0.1          # from "go" to the start instant: every process has its message


@dataclass
class Job:
    """One process's share of a pass."""
    base_url: str             # http://host:port
    model: str
    prompts: list[list[int]]
    max_tokens: list[int]
    offsets: list[float]      # seconds after the start instant
    temperature: float
    timeout: float            # seconds per request
    warm_up: list[int]        # a prompt sent before the start (2 tokens, not measured)


class ClientPool:
    """N client processes (spawned once, used for every pass); a context manager."""

    def __init__(self, n: int):
        ctx = multiprocessing.get_context("spawn")
        self._conns, self._procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_jobs, args=(child,), name=f"http-client-{i}",
                               daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, base_url: str, model: str, prompts: list[list[int]], max_tokens: list[int],
            offsets: list[float], temperature: float, timeout: float,
            warm_ups: list[list[int]]) -> list[Result]:
        """Send request i at offsets[i] from process i % N (after process k sent warm_ups[k]);
        the Results in request order, their times in seconds since the start instant."""
        n = len(self._conns)
        shares = [list(range(k, len(prompts), n)) for k in range(n)]
        for k, (conn, idx) in enumerate(zip(self._conns, shares)):
            conn.send(Job(base_url, model, [prompts[i] for i in idx],
                          [max_tokens[i] for i in idx], [offsets[i] for i in idx],
                          temperature, timeout, warm_ups[k]))
        replies = [conn.recv() for conn in self._conns]          # "ready", or what failed
        failed = [r for r in replies if r != "ready"]
        start = None if failed else time.monotonic() + START_MARGIN_S
        for conn in self._conns:
            conn.send(start)                                      # None: give up
        results: list[Result] = [Result(start=0.0)] * len(prompts)
        for conn, idx in zip(self._conns, shares):
            for i, r in zip(idx, conn.recv()):
                results[i] = r
        if failed:
            raise RuntimeError(f"an HTTP client process failed: {failed[0]}")
        return results

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join()

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve_jobs(conn) -> None:
    """A client process: run each Job it is sent (None: exit). Per Job it answers "ready" (or
    what failed instead), waits for the start instant (None: give up), answers the Results."""
    while (job := conn.recv()) is not None:
        ready: list[bool] = []
        try:
            results = asyncio.run(_run(job, conn, ready))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:300]
            if not ready:                 # in place of "ready": the parent gives up the pass
                conn.send(error)
                conn.recv()
            results = [Result(start=0.0, end=0.0, error=error) for _ in job.prompts]
        conn.send(results)


async def _run(job: Job, conn, ready: list[bool]) -> list[Result]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{job.base_url}/v1", api_key="EMPTY", max_retries=0,
                           timeout=job.timeout) as client:
        warm = await completion(client, job.model, job.warm_up, 2, job.temperature)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        conn.send("ready")
        ready.append(True)
        start = conn.recv()               # blocking, but nothing else runs in this loop yet
        if start is None:
            return []
        base = time.perf_counter() + (start - time.monotonic())

        async def one(prompt: list[int], n: int, offset: float) -> Result:
            await asyncio.sleep(max(0.0, base + offset - time.perf_counter()))
            return await completion(client, job.model, prompt, n, job.temperature)

        results = await asyncio.gather(*(one(p, n, o) for p, n, o in zip(
            job.prompts, job.max_tokens, job.offsets)))
    for r in results:
        r.start, r.end, r.last = r.start - base, r.end - base, r.last - base
    return list(results)


async def completion(client, model: str, prompt: list[int], max_tokens: int,
                     temperature: float) -> Result:
    """One streamed completion through the openai client; never raises (but for
    cancellation): a failure lands in Result.error."""
    r = Result(start=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage and {"completion_tokens": chunk.usage.completion_tokens,
                                     "prompt_tokens": chunk.usage.prompt_tokens}
            r.on_chunk(chunk_text(chunk), usage, now)
        if r.ttft is None:
            r.error = "no content received"
    except Exception as e:                # a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        r.end = time.perf_counter()
        if r.prompt_tokens is None:
            r.prompt_tokens = len(prompt)
    return r


def chunk_text(chunk) -> str:
    """The text of a streamed completion chunk; a server without a tokenizer streams token ids
    instead (conveyor's and vLLM's extra `token_ids`): they count too."""
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    ids = getattr(choice, "token_ids", None)
    return choice.text or (" ".join(map(str, ids)) if ids else "")
