"""Configuration: one frozen dataclass per role.

`EngineConfig` holds what the user chose (vLLM's argument names), `HttpConfig` and `ServeConfig`
what `conveyor serve` adds; what the model files say is `ModelConfig` (shared/model_config.py).
None does I/O when built; bad values raise ValueError naming the argument.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.shared.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from conveyor.shared.links import TcpLinks

QUANTIZATION_MODES = (None, "int8", "fp8")
DP_ROUTING_POLICIES = ("prefix_affinity", "least_loaded", "round_robin")
EXECUTOR_BACKENDS = ("mp", "ray")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM's --dtype spellings for conveyor's three
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# max_num_batched_tokens by (device, offline) when not given. A GPU server keeps steps short for
# the requests already decoding (vLLM's server default); an offline batch gains from fewer, larger
# mixed steps (docs/BENCHMARKS.md). A CPU step's cost grows with its tokens: short steps.
TOKEN_BUDGETS = {("cuda", False): 8192, ("cuda", True): 16384,
                 ("cpu", False): 2048, ("cpu", True): 2048}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class EngineConfig:
    # HF folder, .gguf file or hub id in the local HF cache; None: the default model
    model: str | None = None
    tokenizer: str | None = None             # defaults to the model's own
    revision: str | None = None              # of a hub id: branch, tag or commit (default: main)
    chat_template: str | None = None         # a Jinja file or inline template; None: the model's
    # keys of config.json to replace (vLLM's hf_overrides): a JSON object, or its text
    hf_overrides: str | dict | None = None
    # default sampling: "auto" (the model's generation_config.json), "vllm" (none) or a folder
    generation_config: str = "auto"
    device: str = "auto"                     # "auto" (CUDA when there is one) | "cpu" | "cuda"
    dtype: str = "auto"                      # auto: float32 on CPU, bfloat16 on GPU
    seed: int = 0
    max_model_len: int | None = None         # defaults to the model's context length
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None   # tokens a step; None: by device (TOKEN_BUDGETS)
    # upper bound on waiting requests (more are refused); `serve` also derives one from the pool
    max_queued_requests: int | None = None
    # fcfs | priority | deadline | length-aware | module:Class (docs/SCHEDULING.md)
    scheduling_policy: str = "fcfs"
    max_wait_s: float = 300.0                # fairness guard: a request waiting longer goes first
    enable_prefix_caching: bool = True
    # "sha256", or "sha256-keyed": HMAC-SHA256 under a random key per instance (unpredictable)
    prefix_caching_hash_algo: str = "sha256"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 1 << 30     # KV pool budget on CPU
    num_kv_blocks: int | None = None         # overrides the sizing (tests use tiny pools)
    tensor_parallel_size: int = 1
    # layers split over this many stages, one tensor-parallel group each (`serve` only;
    # docs/ARCHITECTURE.md, "Pipeline parallel")
    pipeline_parallel_size: int = 1
    # `serve` only: engine replicas (each a scheduler with its own tensor-parallel workers)
    # behind the same frontends, and how the frontends pick one per request (docs/ARCHITECTURE.md)
    data_parallel_size: int = 1
    dp_routing_policy: str = "prefix_affinity"   # prefix_affinity | least_loaded | round_robin
    # `serve` only: how workers start. "mp": processes on this host; "ray": actors placed on an
    # existing Ray cluster, possibly over several nodes (docs/MULTI_NODE.md)
    distributed_executor_backend: str = "mp"
    quantization: str | None = None          # None, "int8" (W8A16) or "fp8" (W8A8)
    # comma-separated regexes (re.search on module names such as model.layers.3.mlp.down_proj):
    # matched layers stay in --dtype when quantizing; "" quantizes every layer it can
    keep_precision: str = "lm_head,embed_tokens"
    # "auto": the checkpoint's weights; "dummy": random weights from config.json alone
    # (deterministic from `seed`, the same on every tensor-parallel size; docs/TENSOR_PARALLEL.md)
    load_format: str = "auto"
    # "auto" (the model dtype) | "fp8" (alias "fp8_e4m3"): e4m3 with per-layer scales
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    # the largest step (in tokens) replayed from a CUDA graph; larger ones run eagerly. None:
    # 2048 (ModelRunner._max_graph_tokens); 0: decode-only steps alone
    max_cudagraph_capture_size: int | None = None
    # tensor parallel on CUDA: decode-sized all-reduces (and the RMSNorm after them) in one
    # one-shot kernel over symmetric memory (kernels/all_reduce.py); True: NCCL for all of them
    disable_custom_all_reduce: bool = False
    async_scheduling: bool = True            # plan step N+1 while step N runs (overlap)
    # LoRA adapters (docs/LORA.md): requests pick one by name; the base serves the rest
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()       # name=path of PEFT adapters served from the start
    max_loras: int = 1                       # adapters resident on the device (one step's most)
    max_cpu_loras: int | None = None         # adapters kept in host memory; None: max_loras
    max_lora_rank: int = 16                  # adapters of higher rank are refused
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (one frontend only)
    allow_runtime_lora_updating: bool = False
    # speculative decoding (docs/SPECULATIVE.md): vLLM's JSON, e.g. '{"method": "ngram",
    # "num_speculative_tokens": 4}', or a dict; held as a SpeculativeConfig once built
    speculative_config: str | dict | SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        check(self.device in ("auto", "cpu", "cuda"), "device", "must be 'auto', 'cpu' or 'cuda'")
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        check(self.dtype in ("auto", "float32", "float16", "bfloat16"), "dtype",
              "must be auto, float32 (float), float16 (half) or bfloat16")
        check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
              "must be a power of two up to 256")
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
              "max_num_batched_tokens", "must be at least 1")
        check(self.max_cudagraph_capture_size is None or self.max_cudagraph_capture_size >= 0,
              "max_cudagraph_capture_size", "must be non-negative")
        check(self.max_queued_requests is None or self.max_queued_requests >= 0,
              "max_queued_requests", "must be non-negative")
        check(math.isfinite(self.max_wait_s) and self.max_wait_s > 0, "max_wait_s",
              "must be a positive number of seconds")
        if self.max_model_len == -1:         # vLLM's spelling of "the model's own"
            object.__setattr__(self, "max_model_len", None)
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
              "must be at least 1 (or -1: the model's context length)")
        check(self.prefix_caching_hash_algo in ("sha256", "sha256-keyed"),
              "prefix_caching_hash_algo", "must be 'sha256' or 'sha256-keyed'")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        check(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be positive")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks",
              "must be at least 1")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
        check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be at least 1")
        check(self.data_parallel_size >= 1, "data_parallel_size", "must be at least 1")
        check(self.dp_routing_policy in DP_ROUTING_POLICIES, "dp_routing_policy",
              f"must be one of {', '.join(DP_ROUTING_POLICIES)}")
        check(self.distributed_executor_backend in EXECUTOR_BACKENDS,
              "distributed_executor_backend", f"must be one of {', '.join(EXECUTOR_BACKENDS)}")
        check(self.quantization in QUANTIZATION_MODES, "quantization",
              "must be None, 'int8' or 'fp8'")
        try:
            _ = self.keep_patterns
        except re.error as e:
            raise ValueError(f"keep_precision has an invalid pattern ({e}), "
                             f"got {self.keep_precision!r}") from None
        check(self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'")
        check(self.kv_cache_dtype in ("auto", "fp8", "fp8_e4m3"), "kv_cache_dtype",
              "must be 'auto', 'fp8' or 'fp8_e4m3'")
        check(self.max_loras >= 1, "max_loras", "must be at least 1")
        check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
              "max_cpu_loras", "must be at least max_loras")
        check(1 <= self.max_lora_rank <= 512, "max_lora_rank", "must be in [1, 512]")
        check(self.enable_lora or not (self.lora_modules or self.allow_runtime_lora_updating),
              "enable_lora", "must be set for lora_modules and allow_runtime_lora_updating")
        if not isinstance(self.lora_modules, tuple):     # a list, or one str
            object.__setattr__(self, "lora_modules", tuple(
                [self.lora_modules] if isinstance(self.lora_modules, str) else self.lora_modules))
        from conveyor.shared.lora import parse_lora_modules

        parse_lora_modules(self.lora_modules)
        if isinstance(self.hf_overrides, str):
            try:
                object.__setattr__(self, "hf_overrides", json.loads(self.hf_overrides))
            except json.JSONDecodeError as e:
                raise ValueError(f"hf_overrides: not JSON ({e})") from None
        check(self.hf_overrides is None or isinstance(self.hf_overrides, dict), "hf_overrides",
              "must be a JSON object of config.json keys")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config))
            draft_tp = self.speculative_config.draft_tensor_parallel_size
            if draft_tp not in (None, 1, self.tensor_parallel_size):
                raise ValueError(f"speculative_config: draft_tensor_parallel_size must be 1 or "
                                 f"tensor_parallel_size ({self.tensor_parallel_size}), got "
                                 f"{draft_tp}")
        if self.pipeline_parallel_size > 1:
            # NOTE: each of these needs what only one stage has: guesses are verified and
            # rolled back where they are drawn, adapters span every layer, and the fp8 KV
            # scales are calibrated by a forward pass through the whole model
            for name, on in (("speculative_config", self.speculative_config is not None),
                             ("enable_lora", self.enable_lora),
                             ("kv_cache_dtype", self.kv_cache_fp8)):
                if on:
                    raise ValueError(f"{name} {getattr(self, name)!r} cannot be combined with "
                                     f"pipeline_parallel_size "
                                     f"{self.pipeline_parallel_size} (not built)")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, typed (None: no speculative decoding)."""
        return self.speculative_config  # type: ignore[return-value]

    @property
    def world_size(self) -> int:
        """Worker ranks of one replica: tensor parallel x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def keep_patterns(self) -> tuple[re.Pattern, ...]:
        """The --keep-precision regexes, compiled (empty pieces ignored)."""
        return tuple(re.compile(p.strip()) for p in self.keep_precision.split(",") if p.strip())

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def cpu_loras(self) -> int:
        """Adapters kept in host memory (max_cpu_loras, at least max_loras)."""
        return self.max_cpu_loras or self.max_loras

    @property
    def kv_cache_fp8(self) -> bool:
        """Whether the KV pool holds float8 e4m3 (else the model dtype)."""
        return self.kv_cache_dtype != "auto"

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def with_defaults(self, offline: bool, cuda: bool | None = None) -> EngineConfig:
        """This config with what was left to choose chosen: the device ("auto": CUDA when
        `cuda`, by default whether torch sees a GPU) and the token budget (TOKEN_BUDGETS)."""
        device = self.device
        if device == "auto":
            device = "cuda" if (cuda_available() if cuda is None else cuda) else "cpu"
        budget = self.max_num_batched_tokens or TOKEN_BUDGETS[device, offline]
        return self.replace(device=device, max_num_batched_tokens=budget)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP API every frontend serves on one shared port."""
    port: int | None = 8000                  # None: no HTTP server; 0: any free port
    served_model_names: tuple[str, ...] = ()  # names clients may use; default: the model's name
    api_keys: tuple[str, ...] = ()           # empty: no authentication
    rate_limit: float | None = None          # requests per second per API key (token bucket)
    rate_limit_burst: int = 0                # bucket size; 0: max(1, rate_limit)
    max_concurrent_requests: int | None = None   # open requests per server; more get 429
    request_timeout: float | None = None     # seconds; a request running longer is aborted
    max_body_bytes: int = 8 << 20
    max_n: int = 64                          # sequences per request (n, times the prompts)
    read_timeout: float = 30.0               # seconds to receive a request's headers and body
    shutdown_timeout: float = 30.0           # SIGTERM: seconds in-flight requests get to finish
    cache_salt_per_api_key: bool = False     # each API key (tenant) gets its own prefix cache
    enable_auto_tool_choice: bool = False    # tool_choice "auto" reads calls with tool_call_parser
    tool_call_parser: str | None = None      # a name in conveyor/frontend/tool_parsers
    reasoning_parser: str | None = None      # qwen3 | deepseek_r1 | openai_gptoss: the thought
    metrics_need_api_key: bool = False       # /metrics asks for the API key too (else open)
    uvicorn_log_level: str = "warning"       # info and below also log each HTTP request
    ssl_keyfile: str | None = None           # HTTPS: the server's private key and certificate
    ssl_certfile: str | None = None
    # CORS: the browser origins whose pages may call the API ("*": any); none: no CORS headers
    allowed_origins: tuple[str, ...] = ()

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def __post_init__(self) -> None:
        from conveyor.frontend.reasoning import REASONING_PARSERS
        from conveyor.frontend.tool_parsers import TOOL_PARSERS

        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.tool_call_parser == "openai" and self.reasoning_parser is None:
            # gpt-oss's calls are harmony messages: the harmony reader hands them on
            object.__setattr__(self, "reasoning_parser", "openai_gptoss")
        if (self.tool_call_parser == "openai") != (self.reasoning_parser == "openai_gptoss") \
                and self.tool_call_parser is not None:
            raise ValueError("gpt-oss's calls are harmony messages: tool_call_parser openai and "
                             "reasoning_parser openai_gptoss go together")
        for name, value, known in (("tool_call_parser", self.tool_call_parser, TOOL_PARSERS),
                                   ("reasoning_parser", self.reasoning_parser,
                                    REASONING_PARSERS)):
            if value is not None and value not in known:
                raise ValueError(f"{name} must be one of {', '.join(known)}, got {value!r}")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be a TCP port, got {self.port}")
        for name in ("rate_limit", "request_timeout", "read_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("max_concurrent_requests", "max_body_bytes", "max_n"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.rate_limit_burst < 0 or self.shutdown_timeout < 0:
            raise ValueError("rate_limit_burst and shutdown_timeout must be non-negative")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both ssl_keyfile and ssl_certfile")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")


@dataclass(frozen=True)
class ServeConfig:
    """What `conveyor serve` hands every child process (besides its rank or index)."""
    engine: EngineConfig
    runtime_dir: str                         # private ipc:// socket folder of this instance
    launcher_pid: int
    host: str = "127.0.0.1"                  # the HTTP port's address
    zmq_port: int = 0                        # frontend i listens on zmq_port + i (0: any port)
    num_frontends: int = 1
    zmq_curve_keys: str | None = None        # folder with the CurveZMQ server keypair
    http: HttpConfig = field(default_factory=HttpConfig)
    skip_tokenizer_init: bool = False        # no tokenizer: clients send and get token ids
    zmq_host: str = "127.0.0.1"              # the ZMQ engine port's address (see engine_port.py)
    # workers on other hosts (Ray): the scheduler's worker links over CurveZMQ TCP; None: ipc://
    links: TcpLinks | None = None

    def __post_init__(self) -> None:
        if self.num_frontends < 1:
            raise ValueError(f"frontends must be at least 1, got {self.num_frontends}")
        if not 0 <= self.zmq_port <= 65535 - self.num_frontends:
            raise ValueError(f"zmq_port must be a TCP port, got {self.zmq_port}")
        if self.engine.allow_runtime_lora_updating and self.num_frontends > 1:
            # NOTE: each frontend keeps its own table of adapters; one load reaches one of them
            raise ValueError(f"allow_runtime_lora_updating needs one frontend (--frontends 1), "
                             f"got {self.num_frontends}")
