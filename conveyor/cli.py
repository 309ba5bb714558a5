"""The command line: `conveyor generate | chat | serve | fetch-default-model`.

`conveyor serve [MODEL]` as `vllm serve MODEL`. Engine arguments are EngineConfig's fields as
kebab-case flags with vLLM's names and value forms (conveyor/cli_args.py); `--help` groups them.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from conveyor.cli_args import (
    Parser,
    add_engine_args,
    add_server_log_args,
    engine_kwargs,
    group,
)
from conveyor.shared.config import EngineConfig, HttpConfig

__all__ = ["add_engine_args", "build_parser", "engine_kwargs", "main"]


def _sampling(args: argparse.Namespace):
    from conveyor import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed_sampling)


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = group(parser, "sampling")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens this likely (default: 1, off)")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens (default: 0, off)")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"most tokens a reply may have (default: {max_tokens})")
    g.add_argument("--seed-sampling", type=int, default=None,
                   help="per-request seed (default: the engine's)")


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


CHAT_HELP = "type a message; /reset forgets the conversation, /exit (or Ctrl-D) quits, " \
            "Ctrl-C stops a reply"


def cmd_chat(args) -> int:
    llm = _llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    print(f"conveyor chat: {CHAT_HELP}.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            history = list(system)
            print("(conversation forgotten)", file=sys.stderr)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        history.append({"role": "assistant", "content": _reply(llm, history, _sampling(args))})


def _reply(llm, history: list[dict], params) -> str:
    """Stream one reply to stdout; Ctrl-C stops it (the text so far stays the reply)."""
    reply, stopped = "", []
    # NOTE: Ctrl-C between two steps, never inside one: leaving the stream aborts the reply
    previous = signal.signal(signal.SIGINT, lambda *_, s=stopped: s.append(True))
    try:
        for piece in llm.stream(history, params):
            reply += piece
            print(piece, end="", flush=True)
            if stopped:
                print(" [stopped]", end="")
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    print(flush=True)
    return reply


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
        cache_salt_per_api_key=args.cache_salt_per_api_key,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        metrics_need_api_key=args.metrics_need_api_key,
        uvicorn_log_level=args.uvicorn_log_level, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, allowed_origins=tuple(args.allowed_origins or ()))


def cmd_serve(args) -> int:
    from conveyor.launcher import LaunchError, serve

    try:
        return serve(EngineConfig.from_kwargs(**engine_kwargs(args)), http_config(args),
                     host=args.host, zmq_port=args.zmq_port, num_frontends=args.frontends,
                     curve_keys=args.zmq_curve_keys, startup_timeout=args.startup_timeout,
                     skip_tokenizer_init=args.skip_tokenizer_init, zmq_host=args.zmq_host)
    except LaunchError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2


def cmd_fetch(args) -> int:
    from conveyor.shared.model_files import fetch_default_model

    print(fetch_default_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="conveyor", description="a small, fast LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the results",
                         usage="conveyor generate [options] PROMPT [PROMPT ...]")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="the prompts to complete")
    gen.add_argument("--echo", action="store_true", help="print the prompt before its completion")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the chat template")
    _add_sampling_args(gen, max_tokens=64)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model in the terminal",
                          usage="conveyor chat [options]",
                          description=f"conveyor chat: {CHAT_HELP}")
    chat.add_argument("--system", default=None, help="a system message")
    _add_sampling_args(chat, max_tokens=512)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser("serve", help="run the engine as a server (OpenAI HTTP API and ZMQ)",
                         usage="conveyor serve [MODEL] [options]",
                         description="conveyor serve [MODEL]: the OpenAI-compatible HTTP API "
                                     "and the ZMQ client protocol")
    srv.add_argument("model_arg", nargs="?", metavar="MODEL",
                     help="a Hugging Face folder, a .gguf file, or a hub id (org/name) in the "
                          "local Hugging Face cache (the same as --model; default: "
                          "SmolLM2-135M-Instruct)")
    g = group(srv, "server")
    g.add_argument("--host", default="127.0.0.1", help="address the HTTP port binds")
    g.add_argument("--port", type=int, default=8000,
                   help="OpenAI-compatible HTTP port (0: any free port; -1: no HTTP server)")
    g.add_argument("--served-model-name", nargs="+", action="extend", metavar="NAME",
                   help="model name(s) clients use (several, or the flag repeated); the first "
                        "names the model in responses and metrics (default: the model "
                        "argument)")
    g.add_argument("--api-key", action="append", metavar="KEY",
                   help="require this bearer key on the HTTP API (repeatable; default: the "
                        "comma-separated keys in $CONVEYOR_API_KEY, if set); /health, /ping, "
                        "/version and /metrics answer without it")
    g.add_argument("--metrics-need-api-key", action="store_true",
                   help="/metrics also requires the API key")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="serve HTTPS with this private key (PEM; with --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate chain (PEM; with --ssl-keyfile)")
    g.add_argument("--allowed-origins", nargs="+", action="extend", metavar="ORIGIN",
                   help="answer CORS requests from these browser origins, e.g. "
                        "https://app.example.com (* for any; default: no CORS headers, so "
                        "browsers keep other sites' pages from reading the API)")
    g.add_argument("--rate-limit", type=float, default=None, metavar="RPS",
                   help="requests per second per API key (token bucket)")
    g.add_argument("--rate-limit-burst", type=int, default=0, metavar="N",
                   help="token bucket size (default: max(1, RPS))")
    g.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                   help="open requests beyond this get HTTP 429 / a ZMQ error")
    g.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort requests running longer than this")
    g.add_argument("--max-request-body-bytes", type=int, default=8 << 20, metavar="BYTES",
                   help="larger HTTP request bodies get 413 (default: 8 MiB)")
    g.add_argument("--max-n", type=int, default=64,
                   help="most sequences one request may ask for (n, times the prompts)")
    g.add_argument("--http-read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="close a connection whose request (headers and body) takes longer "
                        "to arrive")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests get to finish")
    g.add_argument("--cache-salt-per-api-key", action="store_true",
                   help="requests of different API keys never share prefix-cache blocks")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"), read with '
                        '--tool-call-parser')
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls: hermes (Qwen2.5/Qwen3), "
                        "llama3_json (Llama 3.1/3.2), mistral, pythonic (Llama 3.2/4), "
                        "qwen3_coder, glm45 / glm47 (GLM-4.5 to 4.7), minimax_m2, "
                        "openai (gpt-oss)")
    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the model's thought into reasoning_content: qwen3 (or glm45), "
                        "deepseek_r1 (<think>...</think>; or minimax_m2), openai_gptoss "
                        "(gpt-oss's channels; "
                        "the default for gpt-oss)")
    g.add_argument("--zmq-port", type=int, default=5555,
                   help="frontend i listens on ZMQ_PORT + i (0: any free port)")
    g.add_argument("--frontends", type=int, default=None,
                   help="number of frontend processes (default: one per 4 cores, 1 to 8)")
    g.add_argument("--zmq-host", default="127.0.0.1",
                   help="address the ZMQ engine port binds; beyond loopback it requires "
                        "CurveZMQ with client keys in DIR/clients/ (see --zmq-curve-keys)")
    g.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                   help="require CurveZMQ: server keypair in DIR (created if missing); with "
                        "DIR/clients/, only the client public keys (*.key) there (default "
                        "with a --zmq-host beyond loopback: $CONVEYOR_CACHE/zmq-keys)")
    g.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up when the engine is not ready after this long")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts and outputs are token ids only")
    add_server_log_args(g)
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
    except KeyboardInterrupt:                    # e.g. Ctrl-C while the model loads
        print(file=sys.stderr)
        return 130
    except ModelNotFound as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
