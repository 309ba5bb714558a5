"""Where structured outputs' mask fill should run, measured on the host alone (no model): a
step loop of --work-ms of pure-Python work a step (the stand-in for planning, building inputs
and launching) with --rows sequences under the typical JSON schema of
benchmarks/structured_outputs.py on the default model's vocabulary. Each step the loop takes
every row's token from the last mask (a random allowed one) and the matchers consume it and fill
the next mask:

- none: no constraint; the loop's work and the token picks alone (the baseline);
- serial: the fill on the loop's thread;
- thread: the fill on a thread while the loop works (the engine's way, worker/structured.py,
  with its GIL switch interval);
- process: the matchers in a child process, the tokens sent over a pipe and the mask written
  into shared memory while the loop works.

The figure is each mode's mean step time against none's (the first --skip steps left out), and
the mean fill time as the filling side saw it. --threads sets llguidance's fill threads (the
engine's default: grammar.FILL_THREADS).

    python scripts/bench_mask_fill_host.py [--work-ms 1.0] [--rows 64] [--threads 1 2 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import get_context, shared_memory

import numpy as np

from benchmarks.structured_outputs import schema


def _model():
    from conveyor.shared.model_files import default_model_path, read_model_config, resolve_model

    files = resolve_model(str(default_model_path()))
    return files, read_model_config(files)


def mask_width() -> int:
    from conveyor.shared.grammar import bitmask_width

    return bitmask_width(_model()[1].vocab_size)


def matchers(rows: int, threads: int | None):
    """The default model's grammar compiler and `rows` fresh matchers of the schema."""
    from conveyor.frontend.tokenizer import load_tokenizer
    from conveyor.shared.grammar import FILL_THREADS, GrammarCompiler, build_tokenizer
    from conveyor.shared.structured_outputs import StructuredOutputs

    files, cfg = _model()
    tokenizer = build_tokenizer(load_tokenizer(files, None), cfg.vocab_size, cfg.eos_token_ids)
    compiler = GrammarCompiler(tokenizer, cfg.vocab_size, cfg.eos_token_ids,
                               fill_threads=threads or FILL_THREADS)
    so = StructuredOutputs(json=schema(60))   # no row completes it within the steps
    return compiler, [compiler.start(so, []) for _ in range(rows)]


def pick(mask: np.ndarray, rng: np.random.Generator) -> list[int]:
    """A random allowed token of each row."""
    tokens = []
    for row in mask.view(np.uint32):
        words = np.flatnonzero(row)
        w = int(words[rng.integers(len(words))])
        bits = [i for i in range(32) if int(row[w]) >> i & 1]
        tokens.append(w * 32 + bits[rng.integers(len(bits))])
    return tokens


def work(ms: float) -> None:
    """Pure-Python work for `ms` milliseconds (it holds the GIL as the step loop does)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        sum(range(50))


def _timed_fill(compiler, grammars, mask) -> float:
    t = time.perf_counter()
    compiler.fill_bitmask(grammars, mask)
    return time.perf_counter() - t


def _child(conn, shm_name: str, rows: int, threads: int | None) -> None:
    """The process mode's other side: its own matchers, the mask in shared memory."""
    compiler, grammars = matchers(rows, threads)
    shm = shared_memory.SharedMemory(name=shm_name)
    mask = np.ndarray((rows, mask_width()), dtype=np.int32, buffer=shm.buf)
    conn.send_bytes(b"ready")
    while (msg := conn.recv_bytes()) != b"stop":
        for g, t in zip(grammars, np.frombuffer(msg, dtype=np.int64).tolist()):
            g.accept(t)
        conn.send_bytes(np.float64(_timed_fill(compiler, grammars, mask)).tobytes())
    del mask
    shm.close()


def run(mode: str, threads: int | None, args) -> tuple[float, float]:
    """(mean step ms, mean fill ms) of one mode with `threads` fill threads."""
    rng = np.random.default_rng(0)
    steps, fills = [], []
    width = mask_width()
    if mode == "process":
        shm = shared_memory.SharedMemory(create=True, size=args.rows * width * 4)
        mask = np.ndarray((args.rows, width), dtype=np.int32, buffer=shm.buf)
        conn, other = get_context("spawn").Pipe()
        child = get_context("spawn").Process(target=_child,
                                             args=(other, shm.name, args.rows, threads))
        child.start()
        conn.recv_bytes()
        tokens = []
        for _ in range(args.steps + 1):
            t = time.perf_counter()
            conn.send_bytes(np.asarray(tokens, dtype=np.int64).tobytes())
            work(args.work_ms)
            fills.append(np.frombuffer(conn.recv_bytes(), dtype=np.float64)[0])
            tokens = pick(mask, rng)
            steps.append(time.perf_counter() - t)
        conn.send_bytes(b"stop")
        child.join()
        del mask
        shm.close()
        shm.unlink()
    else:
        compiler, grammars = matchers(args.rows, threads)
        mask = np.zeros((args.rows, width), dtype=np.int32)
        compiler.fill_bitmask(grammars, mask)
        tokens = pick(mask, rng)
        pool = ThreadPoolExecutor(1)
        interval = sys.getswitchinterval()
        if mode == "thread":
            from conveyor.worker.structured import GIL_SWITCH_S

            sys.setswitchinterval(GIL_SWITCH_S)
        for _ in range(args.steps + 1):
            t = time.perf_counter()
            if mode != "none":
                for g, token in zip(grammars, tokens):
                    g.accept(token)
            if mode == "thread":
                fill = pool.submit(_timed_fill, compiler, grammars, mask)
                work(args.work_ms)
                fills.append(fill.result())
            elif mode == "serial":
                fills.append(_timed_fill(compiler, grammars, mask))
                work(args.work_ms)
            else:
                work(args.work_ms)
            tokens = pick(mask, rng)
            steps.append(time.perf_counter() - t)
        pool.shutdown()
        sys.setswitchinterval(interval)
    mean_ms = lambda xs: statistics.mean(xs[args.skip:]) * 1e3 if xs else 0.0  # noqa: E731
    return mean_ms(steps), mean_ms(fills)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-ms", type=float, default=1.0)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="+", default=[None],
                    help="llguidance fill threads (default: the engine's choice)")
    ap.add_argument("--modes", nargs="+", default=["none", "serial", "thread", "process"])
    args = ap.parse_args()
    base = None
    print(f"{'threads':>7}  {'mode':8}  {'step ms':>8}  {'vs none':>8}  {'fill ms':>8}")
    for threads in args.threads:
        for mode in args.modes:
            step, fill = run(mode, threads, args)
            base = step if mode == "none" else base
            extra = f"{step - base:+.3f}" if base is not None and mode != "none" else ""
            print(f"{threads or 'auto':>7}  {mode:8}  {step:8.3f}  {extra:>8}  {fill:8.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
