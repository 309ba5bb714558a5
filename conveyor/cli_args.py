"""The command line's engine flags: vLLM's names and value forms, grouped, each with its help.

Every EngineConfig field is a kebab-case flag (`--max-num-seqs 64`) in one of the groups below;
a field without an entry in ENGINE_FLAGS fails the parser's construction, so none goes out
without help. Values take vLLM's forms: `--dtype half`, `--max-model-len 4k` (k, m, g: powers of
1000; K, M, G: of 1024; -1: the model's own), `-tp 2`. Flags of features conveyor has not built
are refused with a message that says so, and a misspelt flag gets the closest known one.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
import typing

from conveyor.shared.config import (
    DP_ROUTING_POLICIES,
    EXECUTOR_BACKENDS,
    UVICORN_LOG_LEVELS,
    EngineConfig,
)

_UNITS = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def human_int(text: str) -> int:
    """An integer written as vLLM takes it: 4096, 4k (4000), 4K (4096), 1.5M, 1g."""
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not an integer (such as 4096, 4k or 4K): {text!r}")
    value = float(m.group(1)) * _UNITS.get(m.group(2), 1)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def model_len(text: str) -> int | None:
    """--max-model-len: human_int, or -1 / auto for the model's context length (None)."""
    if text.strip().lower() in ("-1", "auto"):
        return None
    value = human_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, or -1 (auto): {text!r}")
    return value


DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# field -> (group, help, extra add_argument keywords)
ENGINE_FLAGS: dict[str, tuple[str, str, dict]] = {
    "model": ("model", "a Hugging Face folder, a .gguf file, or a hub id (org/name) already in "
                       "the local Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub or "
                       "~/.cache/huggingface/hub; nothing is downloaded); default: "
                       "SmolLM2-135M-Instruct", {"metavar": "MODEL"}),
    "tokenizer": ("model", "tokenizer folder or cached hub id (default: the model's own)",
                  {"metavar": "PATH"}),
    "revision": ("model", "of a hub id: the branch, tag or commit to use from the cache "
                          "(default: main)", {"metavar": "REV"}),
    "chat_template": ("model", "chat template to use instead of the model's: a Jinja file, or "
                               "the template itself inline", {"metavar": "FILE_OR_JINJA"}),
    "generation_config": ("model", "default sampling of requests that leave it unset: 'auto' "
                                   "takes temperature, top_p, top_k, min_p, repetition_penalty "
                                   "and max_new_tokens from the model's generation_config.json "
                                   "(as vLLM does); 'vllm' uses none; or a folder holding a "
                                   "generation_config.json", {"metavar": "auto|vllm|FOLDER"}),
    "hf_overrides": ("model", "config.json keys to replace, as vLLM's JSON, e.g. "
                              "'{\"max_position_embeddings\": 65536, \"rope_scaling\": "
                              "{\"rope_type\": \"yarn\", \"factor\": 2.0, "
                              "\"original_max_position_embeddings\": 32768}}' (a nested "
                              "object's keys one by one)", {"metavar": "JSON"}),
    "device": ("model", "where the model runs: auto (CUDA when there is a GPU), cpu or cuda",
               {"choices": ("auto", "cpu", "cuda")}),
    "dtype": ("model", "weights and activations: auto (float32 on CPU, bfloat16 on GPU), half / "
                       "float16, bfloat16, float / float32", {"choices": DTYPES}),
    "seed": ("model", "seed of the engine's random sampling (requests may set their own)", {}),
    "max_model_len": ("model", "context length: prompt plus output tokens of one request "
                               "(4096, 4k, 32K, 1m; -1: the model's own, the default)",
                      {"type": model_len, "metavar": "N"}),
    "load_format": ("model", "auto: the checkpoint's weights; dummy: random weights from "
                             "config.json alone (benchmarks)", {"choices": ("auto", "dummy")}),
    "enforce_eager": ("model", "run every step eagerly: no CUDA graphs", {}),
    "max_cudagraph_capture_size": ("model", "the largest step (tokens) replayed from a CUDA "
                                            "graph; larger ones run eagerly (default 2048; 0: "
                                            "decode-only steps alone)", {}),
    "block_size": ("cache", "tokens per KV cache block (a power of two up to 256)", {}),
    "enable_prefix_caching": ("cache", "reuse the KV cache of prompt prefixes seen before", {}),
    "prefix_caching_hash_algo": ("cache", "block hashes: sha256, or sha256-keyed (HMAC under a "
                                          "random key per instance: unpredictable)",
                                 {"choices": ("sha256", "sha256-keyed")}),
    "gpu_memory_utilization": ("cache", "share of GPU memory the engine may use (weights, "
                                        "activations, KV cache), 0 to 1", {}),
    "kv_cache_memory_bytes": ("cache", "KV cache size on CPU (bytes; 1G, 512M)",
                              {"type": human_int, "metavar": "BYTES"}),
    "num_kv_blocks": ("cache", "KV cache blocks, overriding the sizing (tests)", {}),
    "kv_cache_dtype": ("cache", "auto: the model's dtype; fp8 (fp8_e4m3): float8 with "
                                "per-layer scales, half the memory",
                       {"choices": ("auto", "fp8", "fp8_e4m3")}),
    "max_num_seqs": ("scheduler", "most sequences in one step's batch", {}),
    "max_num_batched_tokens": ("scheduler", "most tokens one step computes (prefill chunks and "
                                            "decodes; default by device: 8192 on GPU, 2048 on "
                                            "CPU)", {"type": human_int, "metavar": "N"}),
    "max_queued_requests": ("scheduler", "waiting requests beyond this are refused with 429 "
                                         "(serve also derives a cap from the KV cache)", {}),
    "scheduling_policy": ("scheduler", "fcfs, priority, deadline, length-aware or "
                                       "module:Class (docs/SCHEDULING.md)",
                          {"metavar": "POLICY"}),
    "max_wait_s": ("scheduler", "a request waiting longer than this many seconds goes first "
                                "(fairness guard)", {"metavar": "SECONDS"}),
    "async_scheduling": ("scheduler", "plan step N+1 while step N runs", {}),
    "enable_lora": ("lora", "serve LoRA adapters (PEFT folders) on the base model", {}),
    "lora_modules": ("lora", "adapters served from the start, as NAME=PATH (several)", {}),
    "max_loras": ("lora", "adapters resident on the device at once (one step's most)", {}),
    "max_cpu_loras": ("lora", "adapters kept in host memory (default: --max-loras)", {}),
    "max_lora_rank": ("lora", "adapters of a higher rank are refused", {}),
    "allow_runtime_lora_updating": ("lora", "POST /v1/load_lora_adapter and "
                                            "/v1/unload_lora_adapter (one frontend)", {}),
    "speculative_config": ("scheduler", "speculative decoding as vLLM's JSON, e.g. "
                                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": "
                                        "4}' (docs/SPECULATIVE.md)", {"metavar": "JSON"}),
    "tensor_parallel_size": ("parallel", "devices (processes) that split each layer", {}),
    "pipeline_parallel_size": ("parallel", "stages the layers are split over (serve only), each "
                                           "a --tp group: PP x TP workers a replica; not with "
                                           "speculative decoding, LoRA or an fp8 KV cache", {}),
    "data_parallel_size": ("parallel", "engine replicas behind one server, each a scheduler with "
                                       "its own --tp workers (on GPU: replica r takes GPUs "
                                       "r*TP to r*TP+TP-1)", {}),
    "dp_routing_policy": ("parallel", "how the frontends pick a replica per request: "
                                      "prefix_affinity (the prompt's first blocks pick it, "
                                      "unless it is much busier than the least loaded), "
                                      "least_loaded or round_robin",
                          {"choices": DP_ROUTING_POLICIES}),
    "distributed_executor_backend": ("parallel", "how workers start: mp (processes on this "
                                                 "host) or ray (actors on an existing Ray "
                                                 "cluster, over several nodes; "
                                                 "docs/MULTI_NODE.md)",
                                     {"choices": EXECUTOR_BACKENDS}),
    "disable_custom_all_reduce": ("parallel", "all-reduce with NCCL only, not conveyor's "
                                              "one-shot kernel for small messages", {}),
    "quantization": ("quantization", "quantize a full-precision model at load: int8 (W8A16) "
                                     "or fp8 (W8A8); prequantized checkpoints load as they are",
                     {"choices": ("int8", "fp8")}),
    "keep_precision": ("quantization", "comma-separated regexes of layers that stay in --dtype "
                                       "when quantizing", {"metavar": "REGEXES"}),
}
_ALIASES = {"tensor_parallel_size": ["-tp", "--tp"], "pipeline_parallel_size": ["-pp", "--pp"],
            "data_parallel_size": ["-dp"]}
GROUPS = {"server": "server", "model": "model", "cache": "KV cache",
          "scheduler": "scheduler", "parallel": "parallel", "quantization": "quantization",
          "lora": "LoRA adapters", "sampling": "sampling", "not built": "not built yet (refused)"}

# vLLM flags of features conveyor has not built: (flags, feature, whether it takes a value,
# values that are what conveyor does anyway and so are accepted)
NOT_BUILT = [
]


class _NotBuilt(argparse.Action):
    """Refuses a flag of a feature not built yet (unless given a value it already means)."""

    def __init__(self, option_strings, dest, feature: str = "", takes_value: bool = True,
                 accepted=(), **kwargs):
        super().__init__(option_strings, dest, nargs="?" if takes_value else 0,
                         default=argparse.SUPPRESS, **kwargs)
        self.feature, self.accepted = feature, accepted

    def __call__(self, parser, namespace, values, option_string=None):
        if values in self.accepted:
            return
        parser.error(f"{option_string}: not built yet in conveyor ({self.feature})")


class _Note(argparse.Action):
    """A vLLM flag accepted for compatibility that changes nothing here; says why once used."""

    def __init__(self, option_strings, dest, note: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)
        self.note = note

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        print(f"conveyor: note: {option_string}: {self.note}", file=sys.stderr)


def group(parser: argparse.ArgumentParser, name: str):
    """The parser's argument group `name` (created once)."""
    groups = parser.__dict__.setdefault("_conveyor_groups", {})
    if name not in groups:
        groups[name] = parser.add_argument_group(GROUPS[name])
    return groups[name]


def add_engine_args(parser: argparse.ArgumentParser, model_flag: bool = True) -> None:
    """EngineConfig's fields as flags (`model` as --model unless model_flag is False: the
    caller adds it as a positional), the accepted vLLM flags and the refused ones."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name not in ENGINE_FLAGS:
            raise RuntimeError(f"EngineConfig.{f.name} has no flag help in ENGINE_FLAGS")
        where, help, extra = ENGINE_FLAGS[f.name]
        if f.name == "model" and not model_flag:
            continue
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        kind = hints[f.name]
        g = group(parser, where)
        default = f.default
        if kind is bool:
            g.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                           help=help)
            continue
        if typing.get_origin(kind) is tuple:                 # a list: --flag a b c
            g.add_argument(*flags, type=typing.get_args(kind)[0], nargs="*", default=default,
                           metavar=f.name.upper(), help=help)
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        kw = {"type": base, "metavar": f.name.upper(), **extra}
        if "choices" in kw:
            kw.pop("metavar")
        g.add_argument(*flags, default=default, help=help + _default_note(default), **kw)
    group(parser, "model").add_argument(
        "--trust-remote-code", action=_Note, help="accepted for vLLM compatibility; conveyor "
        "runs no code from model repositories (its own implementations of the architectures "
        "it supports load the weights), so this changes nothing",
        note="conveyor runs no code from model repositories; this changes nothing")
    for flags, feature, takes_value, accepted in NOT_BUILT:
        group(parser, "not built").add_argument(
            *flags, action=_NotBuilt, feature=feature, takes_value=takes_value,
            accepted=accepted,
            help=f"{feature}: not built yet, refused" + (
                f" (except {', '.join(accepted)}: what conveyor does)" if accepted else ""))


def _default_note(default) -> str:
    return "" if default is None or isinstance(default, bool) else f" (default: {default})"


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def add_server_log_args(g) -> None:
    g.add_argument("--uvicorn-log-level", default="warning", choices=UVICORN_LOG_LEVELS,
                   help="log level of the HTTP server; info and below also log each request "
                        "(default: warning)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM compatibility: conveyor does not log requests (their "
                        "prompts or outputs) in the first place")


class Parser(argparse.ArgumentParser):
    """argparse, with a misspelt flag answered by the closest known one of its command."""

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        command = self.commands.get(getattr(namespace, "command", None), self)
        if extras:
            command.error(unknown_message(extras, command))
        positional = getattr(namespace, "model_arg", None)
        if positional is not None:               # `serve MODEL`, the same as --model
            if namespace.model not in (None, positional):
                command.error(f"the model is given twice: {positional} and --model "
                              f"{namespace.model}")
            namespace.model = positional
        return namespace

    @property
    def commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def unknown_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    flags = [a.split("=", 1)[0] for a in extras if a.startswith("-")]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}"
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(flags[0], known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else f"; see {parser.prog} --help"
    return f"unrecognized argument {flags[0]}{hint}"
