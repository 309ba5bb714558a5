"""A byte-level BPE tokenizer of any vocabulary size, for random-weight models (benchmarks/models.py
writes one into each model folder), so `conveyor serve --model FOLDER` loads a tokenizer and the
HTTP server detokenizes what the model samples.

Built with the `tokenizers` library from a synthetic vocabulary, in about a second for 150k
tokens, the same every time: ids 0-2 are the special tokens <pad>, <s> (bos) and </s> (eos), as
benchmarks.models.hf_config sets them; then the 256 byte symbols (GPT-2's byte-to-unicode map,
so any text encodes); then merges, in order, each joining two existing tokens of ASCII letters
(the second 1-3 letters long, without a leading space mark) into a new word-like token of at most
MAX_TOKEN_CHARS symbols, until the vocabulary is full; a merge extends a word start (a token
with a leading space) with probability WORD_START_SHARE (64 % of the 152k tokens start a
word). Nearly every id decodes to lowercase letters and spaces, so decoding random ids gives
valid text of about 7 characters a token in words of about 11, and detokenizing costs what it
costs with a real vocabulary.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")          # ids 0, 1 (bos), 2 (eos)
BOS_ID, EOS_ID = 1, 2
MAX_TOKEN_CHARS = 8                                # a leading space mark counts as one
WORD_START_SHARE = 0.7                             # of the merged tokens, those with a space
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# a one-line chat template, so the chat route works too (the text is what it is: random weights)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def byte_symbols() -> list[str]:
    """The printable stand-in of each byte 0-255 (GPT-2's bytes_to_unicode): printable Latin-1
    bytes stand for themselves, the others for chr(256 + k)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def synthetic_vocab(vocab_size: int, seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(token -> id, merges in rank order) of a vocabulary of exactly `vocab_size` tokens."""
    symbols = byte_symbols()
    space = symbols[ord(" ")]
    minimum = len(SPECIAL_TOKENS) + len(symbols) + len(LETTERS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} < {minimum}: no room for the merges")
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *symbols])}
    merges: list[tuple[str, str]] = []

    def merge(a: str, b: str) -> str:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        return a + b

    # tokens that may take more letters on the right: [word starts, inside a word]
    growable = [[merge(space, c) for c in LETTERS], list(LETTERS)]
    pieces = list(LETTERS)            # 1-3 letters, no space mark: what is appended
    rand = random.Random(seed).random
    while len(vocab) < vocab_size:
        group = growable[rand() >= WORD_START_SHARE]
        a = group[int(rand() * len(group))]
        b = pieces[int(rand() * len(pieces))]
        if len(a) + len(b) > MAX_TOKEN_CHARS or a + b in vocab:
            continue
        new = merge(a, b)
        if len(new) < MAX_TOKEN_CHARS:
            group.append(new)
        if len(new) <= 3 and group is growable[1]:
            pieces.append(new)
    return vocab, merges


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A `tokenizers.Tokenizer` over synthetic_vocab(vocab_size)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = synthetic_vocab(vocab_size, seed)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    return tok


def save_tokenizer(folder: str | Path, vocab_size: int, model_max_length: int | None = None,
                   seed: int = 0) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `folder`, for
    transformers.AutoTokenizer.from_pretrained(folder); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size, seed).save(str(folder / "tokenizer.json"))
    pad, bos, eos = SPECIAL_TOKENS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": pad, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return folder
