"""Structured outputs without a model: the request forms and their checks, the wire, the
matchers against the grammar they follow (on the default model's vocabulary when it is fetched),
and the sampler never drawing a token its bitmask bans."""
import json
import re

import msgspec
import numpy as np
import pytest
import torch

from conveyor.frontend import openai_protocol as oai
from conveyor.shared.grammar import GrammarCompiler, bitmask_width, build_tokenizer, check
from conveyor.shared.messages import through_wire
from conveyor.shared.messages.worker import NewSeq, StepPlan
from conveyor.shared.model_files import default_model_path
from conveyor.shared.sampling_params import SamplingParams
from conveyor.shared.structured_outputs import StructuredOutputs, from_json_schema
from conveyor.worker.sampler import Sampler, SeqSamplingState

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def test_exactly_one_form():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=[""])
    assert from_json_schema(SCHEMA).kind == "json"


def test_key_is_canonical():
    a = StructuredOutputs(json=SCHEMA)
    b = StructuredOutputs(json=json.dumps(SCHEMA, indent=2))
    assert a.key() == b.key()
    assert a.key() != StructuredOutputs(json={"type": "object"}).key()


def test_sampling_params_cross_the_wire():
    params = SamplingParams(structured_outputs=StructuredOutputs(json=SCHEMA))
    plan = StepPlan(1, [NewSeq(0, [1, 2], 2, params, [0], 0)], [], [])
    assert through_wire(plan).new[0].sampling.structured_outputs.key() == \
        params.structured_outputs.key()
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        msgspec.json.decode(b'{"structured_outputs": {}}', type=SamplingParams)


def _chat(**fields):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return oai.decode_request(json.dumps(body).encode(), oai.ChatRequest)


@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutputs(regex="[ab]+")),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputs(json=json.dumps(SCHEMA))),
    ({"guided_regex": "a"}, StructuredOutputs(regex="a")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputs(choice=["a", "b"])),
    ({"guided_grammar": 'start: "a"'}, StructuredOutputs(grammar='start: "a"')),
])
def test_request_forms(fields, expected):
    got = oai.sampling_params(_chat(**fields)).structured_outputs
    assert got == expected
    completion = oai.decode_request(json.dumps({"prompt": "hi", **fields}).encode(),
                                    oai.CompletionRequest)
    assert oai.sampling_params(completion).structured_outputs == expected


def test_two_forms_are_refused():
    with pytest.raises(ValueError, match="at most one of response_format, guided_regex"):
        oai.sampling_params(_chat(response_format={"type": "json_object"}, guided_regex="a"))


@pytest.mark.parametrize("so,words", [
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strnig"}}}),
     "JSON schema"),
    (StructuredOutputs(regex="(a"), "regex"),
    (StructuredOutputs(grammar="start: nothing_here"), "nothing_here"),
    (StructuredOutputs(grammar="root ::= missing"), "grammar"),
])
def test_check_names_the_problem(so, words):
    with pytest.raises(ValueError, match=words):
        check(so)


def test_check_passes_good_ones():
    for so in (StructuredOutputs(json=SCHEMA), StructuredOutputs(json_object=True),
               StructuredOutputs(regex=r"\d+"), StructuredOutputs(choice=["a", "b"]),
               StructuredOutputs(grammar='start: "a" | "b"'),
               StructuredOutputs(grammar='root ::= "a" | "b"')):      # GBNF
        check(so)


# --- on the default model's vocabulary ------------------------------------------------------

needs_model = pytest.mark.skipif(not default_model_path().is_file(),
                                 reason="default model not fetched")


@pytest.fixture(scope="module")
def vocab():
    from conveyor.frontend.tokenizer import load_tokenizer
    from conveyor.shared.model_files import read_model_config, resolve_model

    files = resolve_model(None)
    config = read_model_config(files)
    hf = load_tokenizer(files)
    compiler = GrammarCompiler(build_tokenizer(hf, config.vocab_size, config.eos_token_ids),
                               config.vocab_size, config.eos_token_ids)
    yield hf, compiler, config
    compiler.close()


def _allowed(compiler, grammars) -> np.ndarray:
    """[len(grammars), V] bool."""
    mask = np.zeros((len(grammars), bitmask_width(compiler.vocab_size)), dtype=np.int32)
    compiler.fill_bitmask(grammars, mask)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    return bits[:, :compiler.vocab_size]


@needs_model
def test_choice_mask_against_the_vocabulary(vocab):
    """The first mask of a choice allows exactly the tokens whose text starts one of the
    choices (or is a whole one); after a whole choice only EOS is allowed."""
    hf, compiler, config = vocab
    choices = ["yes", "no", "maybe so"]
    g = compiler.start(StructuredOutputs(choice=choices), [])
    allowed = _allowed(compiler, [g])[0]
    texts = [hf.decode([t]) for t in range(config.vocab_size)]
    expected = np.array([bool(t) and any(c.startswith(t) for c in choices)
                         and not hf.convert_ids_to_tokens(i).startswith("<") for i, t in
                         enumerate(texts)])
    assert np.array_equal(allowed, expected), (np.nonzero(allowed != expected)[0][:10])
    for t in hf.encode("maybe so", add_special_tokens=False):
        g.accept(t)
    assert np.nonzero(_allowed(compiler, [g])[0])[0].tolist() == list(config.eos_token_ids)


@needs_model
def test_resumed_matcher_equals_one_fed_token_by_token(vocab):
    """A preempted sequence's new matcher replays its output: same state, same mask."""
    hf, compiler, _ = vocab
    so = StructuredOutputs(json=SCHEMA)
    tokens = hf.encode('{"x": 12', add_special_tokens=False)
    fed = compiler.start(so, [])
    fed.ready()
    for t in tokens:
        fed.accept(t)
    resumed = compiler.start(so, tokens)
    both = _allowed(compiler, [fed, resumed])
    assert np.array_equal(both[0], both[1])
    allowed_text = {hf.decode([t]) for t in np.nonzero(both[0])[0]}
    assert "3" in allowed_text and "}" in allowed_text and "a" not in allowed_text


@needs_model
def test_a_fill_consumes_the_queued_tokens_as_matchers_fed_directly_would(vocab):
    """accept() only queues a token; the next fill consumes the queue (one token each: one
    parallel call; several: one by one) before it fills. Stepped through documents, rows
    queueing one token, several, and a token after EOS (skipped, as the scheduler drops it)
    get the masks of llguidance matchers fed each token directly."""
    from llguidance.numpy import fill_next_token_bitmask

    hf, compiler, config = vocab
    so = StructuredOutputs(json=SCHEMA)
    texts = ['{"x": 123}', '{"x": -4', '{"x": 56789']
    docs = [hf.encode(t, add_special_tokens=False) for t in texts]
    eos = config.eos_token_ids[0]
    docs[0] += [eos, docs[1][0]]                     # EOS, then a token planned after it
    grammars = [compiler.start(so, []) for _ in docs]
    direct = [compiler.compile(so).result().deep_copy() for _ in docs]
    expected = np.zeros((len(docs), bitmask_width(config.vocab_size)), dtype=np.int32)
    pos, step = [0] * len(docs), 0
    while any(p < len(d) for p, d in zip(pos, docs)):
        for i, (doc, g, m) in enumerate(zip(docs, grammars, direct)):
            take = 2 if i == 2 else 1               # row 2 queues two a step: one by one
            for t in doc[pos[i]:pos[i] + take]:
                g.accept(t)
                if not m.is_stopped():
                    assert m.consume_token(t)
            pos[i] += take
        got = _allowed(compiler, grammars)
        assert all(not g.pending for g in grammars)
        for i, m in enumerate(direct):
            fill_next_token_bitmask(m, expected, i)
        want = np.unpackbits(expected.view(np.uint8), axis=1, bitorder="little").astype(bool)
        assert np.array_equal(got, want[:, :config.vocab_size]), step
        step += 1
    assert grammars[0].matcher.is_stopped() and not grammars[0].matcher.is_error()


@needs_model
def test_guessed_rows_hold_the_mask_after_each_guess_and_the_matcher_steps_back(vocab):
    """With speculative guesses a grammar fills one row more than it has guesses: its mask,
    then the mask after each guess in turn, as a matcher fed them would give; rows past the
    first guess the grammar refuses allow only EOS. After the fill every matcher is back where
    it was: the next fill, without guesses, gives the first rows again."""
    from llguidance.numpy import fill_next_token_bitmask

    hf, compiler, config = vocab
    so = StructuredOutputs(json=SCHEMA)
    eos = config.eos_token_ids[0]
    enc = lambda text: hf.encode(text, add_special_tokens=False)   # noqa: E731
    done = [enc('{"x": '), enc('{"x": 4'), enc('{')]
    guesses = [enc("12}") + [eos], enc("5") + enc("a") + enc("6"), []]
    grammars = [compiler.start(so, []) for _ in done]
    for g, tokens in zip(grammars, done):
        for t in tokens:
            g.accept(t)
    rows = sum(len(g) + 1 for g in guesses)
    width = bitmask_width(config.vocab_size)
    got = np.zeros((rows, width), dtype=np.int32)
    compiler.fill_bitmask(grammars, got, guesses)

    want = np.zeros((rows, width), dtype=np.int32)
    eos_row = np.zeros((1, width), dtype=np.int32)
    eos_row.view(np.uint32)[0, eos // 32] = 1 << (eos % 32)
    row = 0
    for tokens, guess in zip(done, guesses):
        m = compiler.compile(so).result().deep_copy()
        assert m.consume_tokens(tokens)
        refused = False
        for j in range(len(guess) + 1):
            if refused:
                want[row + j] = eos_row
            else:
                fill_next_token_bitmask(m, want, row + j)
                refused = j < len(guess) and not m.try_consume_tokens([guess[j]])
        row += len(guess) + 1
    assert np.array_equal(got, want)
    assert not np.array_equal(got[6], eos_row[0])                          # "5" was taken,
    assert np.array_equal(got[7:9], np.repeat(eos_row, 2, axis=0))        # "a" was not

    again = np.zeros((len(grammars), width), dtype=np.int32)
    compiler.fill_bitmask(grammars, again)
    assert np.array_equal(again, got[[0, 5, 9]])


@needs_model
def test_a_failed_compile_allows_only_eos(vocab):
    from concurrent.futures import Future

    from conveyor.shared.seq_grammar import SeqGrammar

    _, compiler, config = vocab
    failed = Future()
    failed.set_exception(RuntimeError("no tokenizer"))
    allowed = _allowed(compiler, [SeqGrammar(failed, [])])[0]
    assert np.nonzero(allowed)[0].tolist() == list(config.eos_token_ids)


@needs_model
def test_compiles_are_cached(vocab):
    _, compiler, _ = vocab
    so = StructuredOutputs(regex="[0-9]{3}")
    first = compiler.compile(so)
    assert compiler.compile(StructuredOutputs(regex="[0-9]{3}")) is first


@needs_model
def test_sampler_draws_only_allowed_tokens(vocab):
    """Random logits, many sampling modes: every drawn token is one the mask allows, and the
    logprobs put -inf on banned tokens; unconstrained rows are untouched."""
    hf, compiler, config = vocab
    V = config.vocab_size
    sampler = Sampler(V, config.eos_token_ids, 0, "cpu")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=50), SamplingParams(top_p=0.9),
              SamplingParams(min_p=0.1, logprobs=3), SamplingParams(repetition_penalty=1.3)]
    states, grammars = [], []
    for i, p in enumerate(params * 2):
        s = SeqSamplingState.new(p, [1, 2, 3], 3, "cpu")
        if i < len(params):            # constrained rows first, free ones after
            s.grammar = compiler.start(StructuredOutputs(regex=r"[0-9]{2,4}"), [])
            grammars.append(s.grammar)
        states.append(s)
    for _ in range(3):
        allowed = torch.from_numpy(_allowed(compiler, grammars))
        mask = torch.zeros(len(grammars), bitmask_width(V), dtype=torch.int32)
        compiler.fill_bitmask(grammars, mask.numpy())
        logits = torch.randn(len(states), V) * 4
        logits[:, hf.encode("hello", add_special_tokens=False)[0]] = 100.0   # tempting, banned
        out = sampler.sample_tensors(logits, states, (mask, torch.arange(len(grammars))))
        tokens = out.token_ids.tolist()
        for r, t in enumerate(tokens[:len(grammars)]):
            assert allowed[r, t], (r, t, hf.decode([t]))
            assert t in config.eos_token_ids or re.fullmatch(r"[0-9]+", hf.decode([t]))
        assert tokens[len(params)] == int(logits[len(params)].argmax())   # free greedy row
        lp = out.logprobs.tolist()[0]                                     # row 4, constrained
        assert all(allowed[4, t] for t in lp.token_ids)
        for s, g, t in zip(states, grammars, tokens):
            g.accept(t)
            s.token_ids.append(t)


# --- a constraint that starts after a reasoning model's thought ----------------------------------

def test_start_after_is_checked_and_not_part_of_the_key():
    for bad in ([], [-1], ["a"]):
        with pytest.raises(ValueError, match="start_after"):
            StructuredOutputs(regex="a", start_after=bad)
    so = StructuredOutputs(regex="a", start_after=[5, 6])
    assert so.key() == StructuredOutputs(regex="a").key()
    plan = StepPlan(1, [NewSeq(0, [1, 2], 2, SamplingParams(structured_outputs=so), [0], 0)],
                    [], [])
    assert through_wire(plan).new[0].sampling.structured_outputs == so


@needs_model
def test_the_grammar_starts_after_the_start_sequence(vocab):
    """Tokens before `</think>` are free (no mask; a partial `</think>` keeps them free), the
    grammar holds from the token after it, and a replay (preemption) reaches the same state."""
    from conveyor.worker.structured import StructuredOutputMasks

    hf, compiler, config = vocab
    end = hf.encode("</think>", add_special_tokens=False)
    assert len(end) > 1                      # several tokens: the sequence, not one id, counts
    so = StructuredOutputs(regex="[0-9]+", start_after=end)
    thought = hf.encode("<think>\nA number? 7 </think maybe.\n", add_special_tokens=False)
    masks = StructuredOutputMasks(None, None, config.vocab_size, config.eos_token_ids, 4,
                                  torch.device("cpu"))
    masks._compiler = compiler               # the vocabulary's compiler, built by the fixture
    g = compiler.start(so, [])
    for t in thought + end[:-1]:
        g.accept(t)
        assert g.free
    plain = SeqSamplingState.new(SamplingParams(), [1], 1, "cpu")
    free = SeqSamplingState.new(SamplingParams(), [1], 1, "cpu")
    free.grammar = g
    assert masks.masks([plain, free]) is None                    # no row takes a mask yet
    g.accept(end[-1])
    assert not g.free
    constrained = SeqSamplingState.new(SamplingParams(), [1], 1, "cpu")
    constrained.grammar = g
    bits, rows = masks.masks([plain, constrained])
    assert rows.tolist() == [1]
    allowed = {hf.decode([t]) for t in np.nonzero(_allowed(compiler, [g])[0])[0]}
    assert allowed and all(re.fullmatch("[0-9]+", t) for t in allowed)
    digits = hf.encode("42", add_special_tokens=False)
    for t in digits:
        g.accept(t)
    output = thought + end + digits
    resumed = compiler.start(so, output)
    assert not resumed.free
    both = _allowed(compiler, [g, resumed])
    assert np.array_equal(both[0], both[1])
    assert set(config.eos_token_ids) <= set(np.nonzero(both[0])[0].tolist())
    assert compiler.start(so, thought + end[:-1]).free           # replayed, still thinking


def test_thought_open_is_checked_and_needs_start_after():
    with pytest.raises(ValueError, match="thought_open needs start_after"):
        StructuredOutputs(regex="a", thought_open=[5])
    with pytest.raises(ValueError, match="thought_open"):
        StructuredOutputs(regex="a", start_after=[5], thought_open=[])
    so = StructuredOutputs(regex="a", start_after=[5], thought_open=[4])
    assert so.key() == StructuredOutputs(regex="a").key()


def _ids(row: np.ndarray) -> set[int]:
    return set(np.nonzero(row)[0].tolist())


@needs_model
def test_an_optional_thought(vocab):
    """With `thought_open` (qwen3's `<think>`, three tokens of this vocabulary) the first
    tokens' masks allow the grammar's tokens and the opening's next one: an output that takes
    the opening thinks freely until `</think>`; one that leaves it (at its first token or
    later, where the grammar takes the opening's prefix) is held from its first token."""
    hf, compiler, config = vocab
    enc = lambda text: hf.encode(text, add_special_tokens=False)   # noqa: E731
    start, end = enc("<think>"), enc("</think>")
    assert len(start) == 3
    digits = StructuredOutputs(regex="[0-9]+", start_after=end, thought_open=start)
    plain = _allowed(compiler, [compiler.start(StructuredOutputs(regex="[0-9]+"), [])])[0]
    g = compiler.start(digits, [])
    assert g.opening == start and not g.free
    assert _ids(_allowed(compiler, [g])[0]) == _ids(plain) | {start[0]}
    for t in start[:2]:
        g.accept(t)                          # "<", "think": the regex takes neither
        assert _ids(_allowed(compiler, [g])[0]) == {start[g.opened]}
    g.accept(start[2])
    assert g.free and g.opening is None
    for t in enc("\nhm\n") + end:
        g.accept(t)
    assert not g.free
    assert np.array_equal(_allowed(compiler, [g])[0], plain)        # held after the thought
    no_thought = compiler.start(digits, enc("7"))
    assert not no_thought.free and no_thought.opening is None and no_thought.pending == enc("7")
    # a grammar that takes the opening's prefix: leaving the opening after it keeps that prefix
    lt = enc("<")
    any_text = StructuredOutputs(regex="<[a-z]*", start_after=end, thought_open=start)
    g = compiler.start(any_text, lt)
    assert g.opening == start and g.opened == 1
    after_lt = compiler.start(StructuredOutputs(regex="<[a-z]*"), lt)
    assert _ids(_allowed(compiler, [g])[0]) == _ids(_allowed(compiler, [after_lt])[0]) | {
        start[1]}
    x = enc("<x")[-1]
    g.accept(x)
    assert g.opening is None and not g.free and g.pending == lt + [x]


@needs_model
def test_guesses_walk_through_an_opening_thought_and_its_end(vocab):
    """Guesses of a sequence whose phase changes inside them (an opening taken, a thought ended
    by `</think>`, an opening left): each row is the mask the sequence has after the guesses
    before it, as taking them one by one and filling gives."""
    hf, compiler, config = vocab
    enc = lambda text: hf.encode(text, add_special_tokens=False)   # noqa: E731
    start, end = enc("<think>"), enc("</think>")
    so = StructuredOutputs(regex="[0-9]+", start_after=end, thought_open=start)
    cases = [([], start + enc("ok") + end + enc("12")),             # opening, thought, digits
             ([], enc("34") + enc("a") + enc("5")),                 # no thought; "a" refused
             (start + enc("hm"), enc(" x") + end + enc("5"))]       # a thought that ends
    width = bitmask_width(config.vocab_size)
    grammars = [compiler.start(so, done) for done, _ in cases]
    guesses = [guess for _, guess in cases]
    got = np.zeros((sum(len(x) + 1 for x in guesses), width), dtype=np.int32)
    compiler.fill_bitmask(grammars, got, guesses)
    row = 0
    eos_only = set(config.eos_token_ids)
    for done, guess in cases:
        one = compiler.start(so, done)
        refused = False
        for j in range(len(guess) + 1):
            want = eos_only if refused else (
                set(range(config.vocab_size)) if one.free else _ids(_allowed(compiler, [one])[0]))
            assert _ids(_allowed_row(got[row + j], config)) == want, (row, j)
            if j < len(guess):
                refused = refused or guess[j] not in want
                one.accept(guess[j])
        row += len(guess) + 1
    again = _allowed(compiler, grammars)      # the matchers stepped back
    assert all(_ids(a) == _ids(_allowed(compiler, [compiler.start(so, done)])[0])
               for a, (done, _) in zip(again, cases))


def _allowed_row(row: np.ndarray, config) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little").astype(bool)
    return bits[:config.vocab_size]


@needs_model
def test_a_fill_on_the_thread_equals_one_here_and_lowers_the_switch_interval(vocab):
    """`fill(later=True)` gives the same rows and bits as the inline fill, and the first one
    lowers the process's GIL switch interval (restored after the test), so that the fill thread
    gets the GIL back promptly while the step loop runs Python."""
    import sys

    from conveyor.worker import structured
    from conveyor.worker.structured import StructuredOutputMasks

    hf, compiler, config = vocab
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        masks = StructuredOutputMasks(None, None, config.vocab_size, config.eos_token_ids, 4,
                                      torch.device("cpu"))
        masks._compiler = compiler
        states = []
        for text in ('{"a": 1', '{"a": "x', ""):
            g = compiler.start(StructuredOutputs(json={"type": "object"}), [])
            for t in hf.encode(text, add_special_tokens=False):
                g.accept(t)
            st = SeqSamplingState.new(SamplingParams(), [1], 1, "cpu")
            st.grammar = g
            states.append(st)
        here = [t.clone() for t in masks.fill(states, later=False).get()]
        assert sys.getswitchinterval() == 0.005
        pending = masks.fill(states, later=True)
        bits, rows = pending.get()
        assert pending.ready()
        assert torch.equal(bits, here[0]) and torch.equal(rows, here[1])
        assert sys.getswitchinterval() <= structured.GIL_SWITCH_S
    finally:
        sys.setswitchinterval(old)


@needs_model
def test_a_wrapped_byte_level_decoder_is_read_as_bytes(vocab):
    """transformers' GGUF reader (5.17) wraps the byte-level decoder in a Sequence with
    SentencePiece steps: the grammar view must still read "Ġ" as a space, so that every token a
    JSON mask allows is one the matcher then accepts."""
    import json

    from transformers import PreTrainedTokenizerFast

    hf, _, config = vocab
    spec = json.loads(hf.backend_tokenizer.to_str())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, spec["decoder"]]}
    from tokenizers import Tokenizer
    wrapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    view = build_tokenizer(wrapped, config.vocab_size, config.eos_token_ids)
    spaced = hf.convert_tokens_to_ids("\u0120[{")
    assert view.decode_bytes([spaced]) == b" [{"
    compiler = GrammarCompiler(view, config.vocab_size, config.eos_token_ids)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "tags": {"type": "array",
                                                        "items": {"type": "string"}}},
              "required": ["name", "tags"]}
    rng = np.random.default_rng(0)
    grammars = [compiler.start(StructuredOutputs(json=schema), []) for _ in range(4)]
    for _ in range(40):
        allowed = _allowed(compiler, grammars)
        for g, row in zip(grammars, allowed):
            if not g.ready().is_stopped():
                g.accept(int(rng.choice(np.flatnonzero(row))))
                assert not g.ready().is_error(), g.ready().get_error()
    compiler.close()


@needs_model
def test_slices_leave_every_mask_as_it_was(vocab):
    """The engine's token classes (grammar.SLICES) only speed the fill up: along random walks
    through a schema of length-bounded strings, and a regex, each mask equals the one the
    library's default classes give."""
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask

    from conveyor.shared.grammar import to_grammar

    hf, compiler, config = vocab
    ours = compiler.tokenizer
    default = ours.with_slices(llguidance.LLTokenizer.general_slices())
    schema = {"type": "array", "minItems": 3, "items": {
        "type": "object", "required": ["name", "city", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "city": {"type": "string", "minLength": 2, "maxLength": 9},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}}}}}
    rng = np.random.default_rng(1)
    width = bitmask_width(config.vocab_size)
    for so in (StructuredOutputs(json=schema), StructuredOutputs(regex=r"[a-z ]{3,17}\.")):
        for _ in range(3):
            pair = [llguidance.LLMatcher(view, to_grammar(so), log_level=0)
                    for view in (ours, default)]
            for _ in range(60):
                masks = np.zeros((2, width), dtype=np.int32)
                for row, m in enumerate(pair):
                    fill_next_token_bitmask(m, masks, row)
                assert (masks[0] == masks[1]).all()
                bits = np.unpackbits(masks[0].view(np.uint8), bitorder="little")
                token = int(rng.choice(np.flatnonzero(bits[:config.vocab_size])))
                if pair[0].is_stopped() or token in config.eos_token_ids:
                    break
                for m in pair:
                    assert m.consume_token(token)


# --- what masks cost: counters, /metrics, the stats line ------------------------------------

def test_mask_counts_reach_metrics_and_the_stats_line():
    from prometheus_client.parser import text_string_to_metric_families

    from conveyor.frontend.metrics import ServerMetrics
    from conveyor.scheduler.mask_counts import MaskCounts, mask_line
    from conveyor.shared.messages.engine import Stats

    counts = MaskCounts()
    counts.add(0, 0.0, 0.0)                  # a step without constrained rows: not counted
    counts.add(64, 0.002, 0.0005)
    counts.add(32, 0.001, 0.0)
    stats = Stats(**counts.stats())
    body = ServerMetrics().render(stats)[0].decode()
    got = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
    assert got["conveyor:structured_output_steps_total"] == 2
    assert got["conveyor:structured_output_rows_total"] == 96
    assert got["conveyor:structured_output_fill_seconds_total"] == pytest.approx(0.003)
    assert got["conveyor:structured_output_wait_seconds_total"] == pytest.approx(0.0005)
    assert mask_line(stats, Stats()) == (", structured outputs: 48.0 rows/step, bitmask "
                                         "1.50 ms/step, waited for 0.25 ms/step")
    assert mask_line(stats, stats) == ""


def test_an_engine_counts_its_constrained_steps():
    """Offline, through the scheduler's Stats: each of the 6 steps of a batch of two
    constrained requests took a bitmask of two rows; an unconstrained request adds none."""
    from conveyor import LLM

    llm = LLM(max_model_len=256)
    llm.generate(["Hi"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.stats().structured_steps == 0
    so = StructuredOutputs(json={"type": "object"})
    llm.generate(["A JSON object:"] * 2, SamplingParams(temperature=1.0, max_tokens=6,
                                                        ignore_eos=True, seed=1,
                                                        structured_outputs=so), use_tqdm=False)
    stats = llm.engine.scheduler.stats()
    assert stats.structured_steps == 6 and stats.structured_rows == 12
    assert stats.structured_fill_s > 0 and stats.structured_wait_s >= 0
