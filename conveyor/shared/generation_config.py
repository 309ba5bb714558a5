"""Default sampling parameters from a model's generation_config.json, as vLLM reads them.

`--generation-config auto` (the default) takes the model folder's file, `vllm` takes none, and a
folder takes that folder's file. Of the file, only the sampling keys below count; each becomes
the default of a request that does not set that field (over HTTP, and `LLM.generate` without
sampling params). A missing file means no defaults.
"""
from __future__ import annotations

import json
from pathlib import Path

from conveyor.shared.model_files import ModelFiles

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "max_new_tokens": "max_tokens"}


def generation_config_file(files: ModelFiles, choice: str) -> Path | None:
    """The generation_config.json that `choice` names, or None (ValueError for a bad folder)."""
    if choice == "vllm":
        return None
    if choice == "auto":
        path = files.folder / "generation_config.json"
        return path if path.is_file() else None
    folder = Path(choice).expanduser()
    if not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder with "
                         f"generation_config.json, got {choice!r}")
    return folder / "generation_config.json"


def default_sampling(files: ModelFiles, choice: str) -> dict[str, float | int]:
    """{SamplingParams field: value} from the generation config `choice` names."""
    path = generation_config_file(files, choice)
    if path is None:
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    out = {}
    for key, name in SAMPLING_KEYS.items():
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return out
