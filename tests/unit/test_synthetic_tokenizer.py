"""benchmarks/synthetic_tokenizer.py: a byte-level BPE of exactly a shape's vocabulary size that
transformers loads, round-trips text, keeps bos 1 / eos 2, and decodes random ids to plain text."""
import json
import random
import string

import pytest
from transformers import AutoTokenizer

from benchmarks.models import SHAPES, build_random_model
from benchmarks.synthetic_tokenizer import save_tokenizer, synthetic_vocab

QWEN3_VOCAB = SHAPES["qwen3-0.6b"][1]["vocab_size"]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """A qwen3-0.6b folder without weights: config.json and the tokenizer."""
    return build_random_model("qwen3-0.6b", tmp_path_factory.mktemp("qwen3"), weights=False)


def test_the_vocabulary_has_the_shapes_size_and_loads_in_transformers(qwen3_folder):
    tok = AutoTokenizer.from_pretrained(qwen3_folder)
    assert len(tok) == QWEN3_VOCAB
    config = json.loads((qwen3_folder / "config.json").read_text())
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"],
                                                    config["eos_token_id"]) == (1, 2)
    assert max(tok.get_vocab().values()) == QWEN3_VOCAB - 1


@pytest.mark.parametrize("text", ["Hello, world!", " the quick brown fox jumps over 13 lazy dogs",
                                  string.printable, "tab\tand\nnewline  two spaces"])
def test_ascii_text_round_trips(qwen3_folder, text):
    tok = AutoTokenizer.from_pretrained(qwen3_folder)
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < QWEN3_VOCAB for i in ids)
    assert tok.decode(ids) == text


def test_random_ids_decode_to_words(qwen3_folder):
    tok = AutoTokenizer.from_pretrained(qwen3_folder)
    rng = random.Random(0)
    text = tok.decode([rng.randrange(3, QWEN3_VOCAB) for _ in range(2000)])
    plain = sum(c in string.ascii_lowercase + " " for c in text)
    assert plain > 0.995 * len(text)        # the rest: a byte token drawn now and then (1 in 600)
    assert 4 < len(text) / 2000 < 10 and 5 < len(text) / len(text.split()) < 15


def test_deterministic_and_exact_for_any_size(tmp_path):
    for size in (400, 128256):
        vocab, merges = synthetic_vocab(size)
        assert len(vocab) == size == len(set(vocab.values())) and max(vocab.values()) == size - 1
        assert len(merges) == size - 259
    assert synthetic_vocab(5000) == synthetic_vocab(5000)
    save_tokenizer(tmp_path / "a", 5000)
    save_tokenizer(tmp_path / "b", 5000)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="vocab_size"):
        synthetic_vocab(100)
