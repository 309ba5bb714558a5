"""The command line: `conveyor generate | chat | serve | fetch-default-model`.

Engine arguments are EngineConfig's fields as kebab-case flags (`--max-num-seqs 64`), the same
names as vLLM's where one exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from conveyor.shared.config import EngineConfig

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


def cmd_generate(args) -> int:
    from conveyor import LLM

    llm = LLM(**engine_kwargs(args))
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
    from conveyor import LLM

    llm = LLM(**engine_kwargs(args))
    from conveyor.frontend.tokenizer import apply_chat_template

    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("conveyor chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = apply_chat_template(llm.tokenizer, history)
        reply = ""
        for piece in llm.stream(prompt, _sampling(args)):
            reply += piece
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})


def cmd_serve(args) -> int:
    from conveyor.launcher import LaunchError, serve

    try:
        return serve(EngineConfig.from_kwargs(**engine_kwargs(args)), args.host, args.zmq_port,
                     args.frontends, args.zmq_curve_keys, args.startup_timeout)
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

    srv = sub.add_parser("serve", help="run the engine as a server (ZMQ client port)")
    srv.add_argument("--host", default="127.0.0.1", help="address the client port binds")
    srv.add_argument("--zmq-port", type=int, default=5555,
                     help="frontend i listens on ZMQ_PORT + i (0: any free port)")
    srv.add_argument("--frontends", type=int, default=1, help="number of frontend processes")
    srv.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                     help="require CurveZMQ: server keypair in DIR (created if missing)")
    srv.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
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
