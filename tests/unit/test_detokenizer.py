"""Incremental detokenization and stop strings, on the default model's tokenizer."""
import pytest

from conveyor.frontend.detokenizer import IncrementalDetokenizer
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.shared.model_files import default_model_path, resolve_model

pytestmark = pytest.mark.skipif(not default_model_path().is_file(),
                                reason="default model not fetched (make model)")

TEXT = "Héllo wörld! 日本語のテキスト 🙂🚀 — naïve café, tab\tnewline\nend."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


def test_one_token_at_a_time_equals_full_decode(tok):
    ids = tok.encode(TEXT)
    prompt = tok.encode("Say:")
    d = IncrementalDetokenizer(tok, prompt)
    streamed = ""
    for t in ids:
        d.push([t])
        piece = d.stream()
        assert "\ufffd" not in piece          # partial UTF-8 is held back, never emitted
        streamed += piece
    d.flush()
    streamed += d.stream(final=True)
    assert streamed == d.text == tok.decode(ids)


def test_emoji_bytes_held_back(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1                       # byte-level pieces of one character
    d = IncrementalDetokenizer(tok, [])
    d.push(ids[:1])
    assert d.text == ""
    d.push(ids[1:])
    assert d.text == "🙂"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(tok, include):
    ids = tok.encode("The answer is 42. STOP here and more text")
    d = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=include)
    for t in ids:
        d.push([t])
    assert d.stopped_by == "STOP"
    assert d.text == ("The answer is 42. STOP" if include else "The answer is 42. ")


def test_stop_strings_wait_for_min_tokens(tok):
    """As in vLLM: a stop string ends the text only once more than min_tokens tokens were
    generated; one completed before that stays in the text, a later one ends it."""
    ids = tok.encode("one STOP two three four five STOP six")
    first = next(i for i in range(len(ids)) if "STOP" in tok.decode(ids[:i + 1]))
    d = IncrementalDetokenizer(tok, [], stop=["STOP"], min_tokens=first + 1)
    taken = sum(d.push([t]) for t in ids)
    assert d.stopped_by == "STOP" and d.text == "one STOP two three four five "
    assert taken < len(ids)
    d = IncrementalDetokenizer(tok, [], stop=["STOP"], min_tokens=first)
    for t in ids:
        d.push([t])
    assert d.text == "one "

def test_stop_string_across_tokens_and_holdback(tok):
    ids = tok.encode("abc xyz<end>tail")
    d = IncrementalDetokenizer(tok, [], stop=["<end>"])
    out = ""
    for t in ids:
        d.push([t])
        out += d.stream()
        assert "<" not in out                 # a possible stop prefix is never streamed
    assert d.stopped_by == "<end>"
    out += d.stream(final=True)
    assert out == "abc xyz"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi") + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    for d in (skip, keep):
        d.push(ids)
        d.flush()
    assert skip.text == "hi"
    assert keep.text == "hi" + tok.eos_token
