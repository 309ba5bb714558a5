"""The command line: `conveyor generate | chat | serve | fetch-default-model`.

Engine arguments are EngineConfig's fields as kebab-case flags (`--max-num-seqs 64`), the same
names as vLLM's where one exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import typing

from conveyor.shared.config import EngineConfig, HttpConfig

_SKIP = {"model", "tokenizer"}
_ALIASES = {"tensor_parallel_size": ["--tp"]}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default)
            continue
        if typing.get_origin(kind) is tuple:                 # a list: --flag a b c
            parser.add_argument(*flags, type=typing.get_args(kind)[0], nargs="*",
                                default=f.default, metavar=f.name.upper())
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        parser.add_argument(*flags, type=base, default=f.default, metavar=f.name.upper())


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def _sampling(args: argparse.Namespace):
    from conveyor import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed_sampling)


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--seed-sampling", type=int, default=None, help="per-request seed")


def _llm(args):
    """The offline engine of these flags; says what --quantization did on stderr."""
    from conveyor import LLM

    llm = LLM(**engine_kwargs(args))
    if llm.quantization_report is not None:
        print(f"conveyor: {llm.quantization_report.summary()}", file=sys.stderr)
    return llm


def cmd_generate(args) -> int:
    llm = _llm(args)
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, _sampling(args), use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, _sampling(args), use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs):
        for c in out.outputs:
            print(f"{prompt}\n{c.text}" if args.echo else c.text)
            print()
    return 0


def cmd_chat(args) -> int:
    llm = _llm(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("conveyor chat: type a message, Ctrl-D to quit (Ctrl-C stops a reply).",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply, stopped = "", []
        # NOTE: Ctrl-C between two steps, never inside one: leaving the stream aborts the reply
        previous = signal.signal(signal.SIGINT, lambda *_, s=stopped: s.append(True))
        try:
            for piece in llm.stream(history, _sampling(args)):
                reply += piece
                print(piece, end="", flush=True)
                if stopped:
                    print(" [stopped]", end="")
                    break
        finally:
            signal.signal(signal.SIGINT, previous)
        print()
        history.append({"role": "assistant", "content": reply})


def http_config(args) -> HttpConfig:
    keys = args.api_key or [k for k in os.environ.get("CONVEYOR_API_KEY", "").split(",") if k]
    return HttpConfig(
        port=None if args.port < 0 else args.port,
        served_model_names=tuple(args.served_model_name or ()), api_keys=tuple(keys),
        rate_limit=args.rate_limit, rate_limit_burst=args.rate_limit_burst,
        max_concurrent_requests=args.max_concurrent_requests,
        request_timeout=args.request_timeout, max_body_bytes=args.max_request_body_bytes,
        max_n=args.max_n, read_timeout=args.http_read_timeout,
        shutdown_timeout=args.shutdown_timeout,
        cache_salt_per_api_key=args.cache_salt_per_api_key)


def cmd_serve(args) -> int:
    from conveyor.launcher import LaunchError, serve

    try:
        return serve(EngineConfig.from_kwargs(**engine_kwargs(args)), http_config(args),
                     host=args.host, zmq_port=args.zmq_port, num_frontends=args.frontends,
                     curve_keys=args.zmq_curve_keys, startup_timeout=args.startup_timeout,
                     skip_tokenizer_init=args.skip_tokenizer_init)
    except LaunchError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2


def cmd_fetch(args) -> int:
    from conveyor.shared.model_files import fetch_default_model

    print(fetch_default_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="a small, fast LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the results")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--echo", action="store_true", help="print the prompt before its completion")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the chat template")
    _add_sampling_args(gen, max_tokens=64)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    _add_sampling_args(chat, max_tokens=512)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser("serve", help="run the engine as a server (OpenAI HTTP API and ZMQ)")
    srv.add_argument("--host", default="127.0.0.1", help="address the client ports bind")
    srv.add_argument("--port", type=int, default=8000,
                     help="OpenAI-compatible HTTP port (0: any free port; -1: no HTTP server)")
    srv.add_argument("--served-model-name", action="append", metavar="NAME",
                     help="model name clients use (repeatable; default: the model's own name)")
    srv.add_argument("--api-key", action="append", metavar="KEY",
                     help="require this bearer key on the HTTP API (repeatable; default: the "
                          "comma-separated keys in $CONVEYOR_API_KEY, if set)")
    srv.add_argument("--rate-limit", type=float, default=None, metavar="RPS",
                     help="requests per second per API key (token bucket)")
    srv.add_argument("--rate-limit-burst", type=int, default=0, metavar="N",
                     help="token bucket size (default: max(1, RPS))")
    srv.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                     help="open requests beyond this get HTTP 429 / a ZMQ error")
    srv.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="abort requests running longer than this")
    srv.add_argument("--max-request-body-bytes", type=int, default=8 << 20, metavar="BYTES")
    srv.add_argument("--max-n", type=int, default=64,
                     help="most sequences one request may ask for (n, times the prompts)")
    srv.add_argument("--http-read-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="close a connection whose request (headers and body) takes longer "
                          "to arrive")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM, how long in-flight requests get to finish")
    srv.add_argument("--cache-salt-per-api-key", action="store_true",
                     help="requests of different API keys never share prefix-cache blocks")
    srv.add_argument("--zmq-port", type=int, default=5555,
                     help="frontend i listens on ZMQ_PORT + i (0: any free port)")
    srv.add_argument("--frontends", type=int, default=None,
                     help="number of frontend processes (default: one per 4 cores, 1 to 8)")
    srv.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                     help="require CurveZMQ: server keypair in DIR (created if missing); with "
                          "DIR/clients/, only the client public keys (*.key) there")
    srv.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    srv.add_argument("--skip-tokenizer-init", action="store_true",
                     help="load no tokenizer: prompts and outputs are token ids only")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    fetch = sub.add_parser("fetch-default-model", help="download the default model into the cache")
    fetch.set_defaults(func=cmd_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from conveyor.shared.model_files import ModelNotFound

    try:
        return args.func(args)
    except ModelNotFound as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
