"""Load a model's tokenizer and chat template (Hugging Face tokenizers underneath).

For a GGUF model the tokenizer is built from the file's own vocabulary by transformers once
(seconds), then kept as tokenizer.json under ~/.cache/conveyor/tokenizers (a third of a second).
`--chat-template` (a file or an inline Jinja template) replaces the model's chat template.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from conveyor.shared.model_files import ModelFiles, cache_dir, resolve_folder


def read_chat_template(value: str) -> str:
    """The template `value` gives: a file's text, or `value` itself when it is Jinja. ValueError
    if it is neither, or does not parse."""
    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text()
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template does not parse: {e}") from None
    return text


def load_tokenizer(files: ModelFiles, tokenizer: str | None = None,
                   chat_template: str | None = None, revision: str | None = None):
    """The model's tokenizer (or the folder or hub id `tokenizer`), with `chat_template` (a file
    or inline Jinja) as its chat template when given."""
    tok = _load(files, tokenizer, revision)
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def _load(files: ModelFiles, tokenizer: str | None, revision: str | None):
    from transformers import AutoTokenizer

    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(resolve_folder(tokenizer, revision))
    if not files.is_gguf:
        return AutoTokenizer.from_pretrained(files.path)
    cached = cache_dir() / "tokenizers" / f"{files.path.stem}-{files.path.stat().st_size}"
    if not (cached / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(files.path.parent, gguf_file=files.path.name)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cached.parent))
        except OSError:                       # a read-only cache (an image's): serve uncached
            return tok
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)            # atomic: a concurrent loader sees all or nothing
        except OSError:                       # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(cached)


def check_token_ids(token_ids: list[int], vocab_size: int, what: str = "prompt token ids"
                    ) -> None:
    """Token ids given by a client must stay inside the vocabulary (ValueError names the
    culprits)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} out of the vocabulary [0, {vocab_size}): {bad[:5]}")


def template_reads(tokenizer, variable: str) -> bool:
    """Whether the model's chat template mentions `variable` (a request may set only what the
    template would read)."""
    template = tokenizer.chat_template if tokenizer is not None else None
    if isinstance(template, dict):            # named templates: any of them
        template = " ".join(template.values())
    return bool(template) and variable in template


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, add_special_tokens: bool = False,
                        **kwargs) -> list[int]:
    """The prompt's token ids; `tools` and `kwargs` (chat_template_kwargs such as
    enable_thinking) are variables of the template, as in transformers; add_special_tokens:
    the tokenizer's own (a BOS) on top of what the template writes."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; use generate() with a "
                         "plain prompt instead")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:      # the template's own errors (jinja2's are not ValueErrors)
        raise ValueError(f"the chat template failed on these messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
