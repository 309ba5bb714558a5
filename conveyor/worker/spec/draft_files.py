"""The draft model of draft_model speculation: which files and shape, and whether its vocabulary
is the target's.

The draft is `model` (a folder, .gguf file or cached hub id), or the target itself; with
`draft_num_layers` only its first N decoder layers are kept (then its final norm and head), so a
model can draft for itself. Its guesses are token ids the target reads, so both must number
tokens alike: where both have a tokenizer their token lists must be equal, and without one their
vocabulary sizes. The logits' widths may differ (padded embeddings): the draft's are cut or
padded to the target's.
"""
from __future__ import annotations

import json
from dataclasses import replace

from conveyor.shared.model_config import ModelConfig
from conveyor.shared.model_files import ModelFiles, read_model_config, resolve_model
from conveyor.shared.speculative import SpeculativeConfig


def draft_model_files(spec: SpeculativeConfig, target: ModelConfig, target_files: ModelFiles,
                      revision: str | None = None) -> tuple[ModelFiles, ModelConfig]:
    """The draft's files and config; ValueError naming the key when it cannot draft here."""
    files = target_files if spec.model is None else resolve_model(spec.model, revision)
    config = target if files == target_files else read_model_config(files)
    n = spec.draft_num_layers
    if n is not None:
        if n > config.num_hidden_layers:
            raise ValueError(f"speculative_config: draft_num_layers must be at most the draft "
                             f"model's {config.num_hidden_layers} layers, got {n}")
        config = replace(config, num_hidden_layers=n, layer_windows=config.layer_windows[:n])
    if files != target_files:
        check_same_vocab(target_files, target, files, config)
    return files, config


def check_same_vocab(target_files: ModelFiles, target: ModelConfig, draft_files: ModelFiles,
                     draft: ModelConfig) -> None:
    """ValueError unless the draft numbers tokens as the target does."""
    mine, theirs = token_list(target_files), token_list(draft_files)
    where = f"the draft model {draft_files.path}"
    if mine is not None and theirs is not None:
        if mine != theirs:
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                         min(len(mine), len(theirs)))
            raise ValueError(
                f"speculative_config: {where} has another tokenizer than the target "
                f"({len(theirs)} tokens against {len(mine)}; first difference at id {first}: "
                f"{_at(theirs, first)!r} against {_at(mine, first)!r})")
    elif draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: {where} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target {target.vocab_size}")


def _at(tokens: list[str], i: int) -> str | None:
    return tokens[i] if i < len(tokens) else None


def token_list(files: ModelFiles) -> list[str] | None:
    """Each token id's string, from the tokenizer beside the weights (a GGUF file's own
    vocabulary, tokenizer.json or vocab.json); None without one."""
    if files.is_gguf:
        from conveyor.shared.gguf_reader import open_gguf

        field = open_gguf(files.path).fields.get("tokenizer.ggml.tokens")
        return None if field is None else list(field.contents())
    by_id: dict[int, str] = {}
    path = files.folder / "tokenizer.json"
    if path.is_file():
        data = json.loads(path.read_text())
        vocab = data.get("model", {}).get("vocab") or {}
        # BPE and WordPiece: {token: id}; Unigram: [[token, score], ...] in id order
        by_id = ({i: t for t, i in vocab.items()} if isinstance(vocab, dict)
                 else {i: entry[0] for i, entry in enumerate(vocab)})
        by_id.update({a["id"]: a["content"] for a in data.get("added_tokens") or []})
    elif (files.folder / "vocab.json").is_file():
        vocab = json.loads((files.folder / "vocab.json").read_text())
        by_id = {i: t for t, i in vocab.items()}
    if not by_id:
        return None
    return [by_id.get(i, "") for i in range(max(by_id) + 1)]
