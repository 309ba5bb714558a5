"""Where a Hugging Face checkpoint's tensors come from: its safetensors files (those its index
names; Mistral's consolidated.safetensors beside them left out), read one tensor at a time;
and, for a multimodal checkpoint served for its text, its language model's tensors under the
text model's names (`Checkpoint`).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Weights = Iterator[tuple[str, torch.Tensor]]


def checkpoint_files(folder: Path) -> list[Path]:
    """The folder's safetensors files of the Hugging Face checkpoint: those its
    model.safetensors.index.json names, if it has one. Mistral's repositories also hold the
    same weights in their own format (consolidated.safetensors), left out whenever another
    file is there."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(folder / f for f in set(json.loads(index.read_text())["weight_map"]
                                              .values()))
    files = sorted(folder.glob("*.safetensors"))
    hf = [f for f in files if not f.name.startswith("consolidated")]
    if not files and any(folder.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"{folder} holds its weights in pytorch_model*.bin files only: "
                                f"conveyor reads safetensors (no pickle, docs/SECURITY.md); "
                                f"transformers' save_pretrained writes them")
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return hf or files


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face checkpoint's tensors as the engine reads them, one at a time; with
    text_only (a multimodal checkpoint served for its text) its language model's only, under
    the text model's names (its `language_model.` prefix, or transformers' newer
    `model.language_model.`, taken off; the vision tower and the projector left out)."""
    folder: Path
    text_only: bool = False

    def headers(self) -> Iterator[tuple[str, Any]]:
        """(name, its safetensors slice: shape and dtype without reading the tensor), valid
        until the next is drawn."""
        for f, name, ours in self._entries():
            yield ours, f.get_slice(name)

    def names(self) -> list[str]:
        return [ours for _, _, ours in self._entries()]

    def weights(self) -> Weights:
        for f, name, ours in self._entries():
            yield ours, f.get_tensor(name)

    def _entries(self) -> Iterator[tuple[Any, str, str]]:
        """(the open file, a tensor's name in it, the name the engine reads it under)."""
        from safetensors import safe_open

        for file in checkpoint_files(self.folder):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if (ours := self._name(name)) is not None:
                        yield f, name, ours

    def _name(self, name: str) -> str | None:
        if not self.text_only:
            return name
        if name.startswith("language_model."):
            return name.removeprefix("language_model.")
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return None if name.startswith(_NOT_TEXT) else name


_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.", "visual.", "model.visual.", "vision_model.",
             "model.vision_model.")
