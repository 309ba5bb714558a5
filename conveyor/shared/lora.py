"""LoRA adapters in the PEFT format, without torch: the request type, the file checks, the names.

An adapter is a folder with `adapter_config.json` (r, lora_alpha, use_rslora, target_modules)
and `adapter_model.safetensors` (`...layers.<i>.<self_attn|mlp>.<x>_proj.lora_A.weight`
[r, in] and `lora_B.weight` [out, r], x among q, k, v, o, gate, up, down). `check_adapter`
reads the config and the safetensors header only (no tensor), so a frontend refuses an adapter
that does not fit the base model before anything reaches the engine; the workers load the
tensors (worker/lora.py). `LoRARegistry` is a frontend's table of adapters by name.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import msgspec

from conveyor.shared.config import EngineConfig
from conveyor.shared.model_config import ModelConfig


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """An adapter, as vLLM names it: `LoRARequest("sql", 1, "/adapters/sql")`. lora_int_id is
    positive and unique per adapter (it keys the workers' caches and the prefix cache)."""
    lora_name: str
    lora_int_id: int
    lora_path: str


PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(q|k|v|o|gate|up|down)_proj\.lora_([AB])\.weight")
_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    scale: float                             # lora_alpha / r, or / sqrt(r) with use_rslora
    # module name as in the base checkpoint (model.layers.3.self_attn.q_proj) -> A and B names
    modules: dict[str, tuple[str, str]]


# the families whose MLP has no gate (worker/models/llama.py's UpDownMLP)
_NO_GATE = {"ArceeForCausalLM", "ApertusForCausalLM", "Starcoder2ForCausalLM"}
# config.json's count of routed experts, by family: a mixture-of-experts model
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def projection_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of the base model (unsharded)."""
    q = model.num_attention_heads * model.head_dim
    kv = model.num_key_value_heads * model.head_dim
    h, inter = model.hidden_size, model.intermediate_size
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, inter),
            "up": (h, inter), "down": (inter, h)}


def _lacks(model: ModelConfig, proj: str) -> str | None:
    """Why the base model has no LoRA layer for projection `proj` (None: it has one)."""
    if proj in ("gate", "up", "down") and any(model.extra.get(k) for k in _EXPERT_COUNTS):
        return (f"{model.architecture} is a mixture of experts: LoRA adapts its attention "
                f"only (q/k/v/o), not its MLPs")
    if proj == "gate" and model.architecture in _NO_GATE:
        return f"{model.architecture} has no gate_proj"
    return None


def read_safetensors_header(path: Path) -> dict:
    """name -> {"dtype", "shape", "data_offsets"} of a safetensors file, from its header."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError("not a safetensors file (header too large)")
        body = f.read(size)
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (unreadable header)")
    header.pop("__metadata__", None)
    return header


def check_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> AdapterInfo:
    """What the adapter at `path` holds, or ValueError saying why it does not fit `model`."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{folder} is not a PEFT LoRA adapter (it needs adapter_config.json "
                         f"and adapter_model.safetensors)")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file}: unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "fan_in_fan_out", "lora_bias", "modules_to_save", "rank_pattern",
                "alpha_pattern", "layers_to_transform"):
        if cfg.get(key):
            raise ValueError(f"{folder}: {key}={cfg[key]!r} is not supported")
    if cfg.get("bias") not in (None, "none"):
        raise ValueError(f"{folder}: bias={cfg['bias']!r} is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{folder}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{folder}: rank {rank} exceeds max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{folder}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    try:
        header = read_safetensors_header(weights_file)
    except OSError as e:
        raise ValueError(f"{weights_file}: unreadable ({e})") from None
    except ValueError as e:
        raise ValueError(f"{weights_file}: {e}") from None
    shapes = projection_shapes(model)
    parts: dict[str, dict[str, str]] = {}
    for name, meta in header.items():
        m = _TENSOR.fullmatch(name)
        if m is None:
            raise ValueError(f"{folder}: unsupported tensor {name!r} (conveyor applies LoRA to "
                             f"the q/k/v/o/gate/up/down projections only)")
        layer, proj, which = int(m.group(1)), m.group(3), m.group(4)
        if (why := _lacks(model, proj)) is not None:
            raise ValueError(f"{folder}: {name}: {why}")
        if layer >= model.num_hidden_layers:
            raise ValueError(f"{folder}: {name} is for layer {layer}, but the base model has "
                             f"{model.num_hidden_layers} layers")
        fan_in, fan_out = shapes[proj]
        want = [rank, fan_in] if which == "A" else [fan_out, rank]
        if not isinstance(meta, dict) or meta.get("shape") != want:
            got = meta.get("shape") if isinstance(meta, dict) else meta
            raise ValueError(f"{folder}: {name} has shape {got}, the base model needs {want}")
        if meta.get("dtype") not in _DTYPES:
            raise ValueError(f"{folder}: {name} has dtype {meta.get('dtype')}; adapters load "
                             f"from F32, F16 or BF16")
        module = f"model.layers.{layer}.{m.group(2)}.{proj}_proj"
        parts.setdefault(module, {})[which] = name
    if not parts:
        raise ValueError(f"{folder}: the adapter has no LoRA tensors")
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise ValueError(f"{folder}: {module} has no lora_{missing}")
    return AdapterInfo(rank, scale, {m: (ab["A"], ab["B"]) for m, ab in parts.items()})


def parse_lora_modules(specs: tuple[str, ...]) -> list[tuple[str, str]]:
    """--lora-modules name=path ... -> [(name, path)], ValueError on a malformed one."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules entries are name=path, got {spec!r}")
        out.append((name, path))
    return out


class LoRARegistry:
    """A frontend's adapters by name, each checked against the base model when added."""

    def __init__(self, model: ModelConfig, max_rank: int, base_names: tuple[str, ...] = ()):
        self.model, self.max_rank, self.base_names = model, max_rank, base_names
        self.adapters: dict[str, LoRARequest] = {}
        self._used_ids: set[int] = set()     # never reused: an id names one set of weights

    def add(self, lora: LoRARequest) -> bool:
        """Register an adapter (ValueError if it does not fit or clashes); False if this exact
        adapter was registered already."""
        if self.adapters.get(lora.lora_name) == lora:
            return False
        if not lora.lora_name or lora.lora_name in self.base_names:
            raise ValueError(f"the adapter name {lora.lora_name!r} is empty or the base model's")
        if lora.lora_name in self.adapters:
            raise ValueError(f"the adapter {lora.lora_name!r} is already loaded")
        if isinstance(lora.lora_int_id, bool) or lora.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {lora.lora_int_id!r}")
        if lora.lora_int_id in self._used_ids:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already used by another adapter")
        check_adapter(lora.lora_path, self.model, self.max_rank)
        self.adapters[lora.lora_name] = lora
        self._used_ids.add(lora.lora_int_id)
        return True

    def add_path(self, name: str, path: str) -> LoRARequest:
        """Register the adapter at `path` under `name` with a fresh id."""
        lora = LoRARequest(name, max(self._used_ids, default=0) + 1, str(path))
        self.add(lora)
        return lora

    def remove(self, name: str) -> None:
        """KeyError if unknown. Requests already accepted keep their adapter to the end."""
        del self.adapters[name]

    def resolve(self, name: str) -> LoRARequest:
        lora = self.adapters.get(name)
        if lora is None:
            known = ", ".join(self.adapters) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return lora


def lora_registry(config: EngineConfig, model: ModelConfig, base_names: tuple[str, ...] = ()
                  ) -> LoRARegistry | None:
    """An engine's table of adapters, with those of lora_modules checked and registered (ids
    1, 2, ... in order); None without enable_lora."""
    if not config.enable_lora:
        return None
    if model.extra.get("kv_lora_rank"):
        raise ValueError(f"LoRA adapters are not supported for {model.architecture} (its "
                         f"multi-head latent attention has no q/k/v projections to adapt)")
    registry = LoRARegistry(model, config.max_lora_rank, base_names)
    for name, path in parse_lora_modules(config.lora_modules):
        registry.add_path(name, path)
    return registry
