"""FrontendCore, the one request path, without an engine: what it refuses and what it delivers,
and that no failure of the tokenizer, the template or the detokenizer reaches beyond its request."""
import asyncio
import time

import pytest

from conveyor.frontend.core import READY, FrontendCore, RequestError
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.messages.engine import Abort, AddRequest, Stats, StatsRequest, TokenOutput
from conveyor.shared.model_files import default_model_path, resolve_model
from conveyor.shared.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not default_model_path().is_file(),
                                reason="default model not fetched (make model)")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


def test_a_chat_template_error_refuses_that_request_alone(tok):
    sent = []
    core = FrontendCore(tok, len(tok), 2048, "f-", sent.append, state=READY)
    with pytest.raises(RequestError, match="chat template failed") as e:   # a TypeError inside
        core.submit(GenerateRequest(id="a", messages=[{"role": "user", "content": "Hi"}],
                                    chat_template_kwargs={"tokenize": True}), print)
    assert e.value.code == 400 and sent == [] and not core.open
    with pytest.raises(RequestError, match=r"messages\[1\] needs a role") as e:
        core.submit(GenerateRequest(id="a", messages=[{"role": "user", "content": "Hi"},
                                                      {"content": "no role"}]), print)
    assert e.value.code == 400 and sent == [] and not core.open
    core.submit(GenerateRequest(id="b", messages=[{"role": "user", "content": "Hi"}]), print)
    assert [type(m) for m in sent] == [AddRequest] and len(core.open) == 1


def test_stream_deltas_add_up_and_a_stop_string_aborts_in_the_engine(tok):
    sent, got = [], []
    core = FrontendCore(tok, len(tok), 2048, "f-", sent.append, state=READY)
    params = SamplingParams(max_tokens=50, stop=["STOP"])
    rid = core.submit(GenerateRequest(id="a", prompt="Say:", sampling=params, stream=True),
                      got.append)
    for t in tok.encode("one two STOP three", add_special_tokens=False):
        core.on_outputs([TokenOutput(f"{rid}/0", [t])])
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "stop"
    assert "".join(c.text for out in got for c in out.outputs) == "one two "
    assert got[0].prompt_token_ids == tok.encode("Say:")          # in the first delta only
    assert all(out.prompt_token_ids is None for out in got[1:])
    assert isinstance(sent[-1], Abort) and sent[-1].ids == [f"{rid}/0"] and not core.open


class _Broken:
    """The real tokenizer, but encode raises what a buggy tokenizer might (not a ValueError),
    and counts its calls."""

    def __init__(self, tok, error: Exception | None = None):
        self.tok, self.error, self.calls = tok, error, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, *args, **kwargs):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.tok.encode(*args, **kwargs)


def test_a_tokenizer_exception_fails_that_request_alone(tok):
    sent = []
    broken = _Broken(tok, RuntimeError("tokenizer bug"))
    core = FrontendCore(broken, len(tok), 2048, "f-", sent.append, state=READY)
    with pytest.raises(RequestError, match="RuntimeError: tokenizer bug") as e:
        core.submit(GenerateRequest(id="a", prompt="Hi"), print)
    assert e.value.code == 500 and sent == [] and not core.open
    broken.error = None
    core.submit(GenerateRequest(id="b", prompt="Hi"), print)
    assert [type(m) for m in sent] == [AddRequest]


def test_a_detokenizer_exception_fails_that_request_alone(tok):
    sent, got = [], {}
    core = FrontendCore(tok, len(tok), 2048, "f-", sent.append, state=READY)
    bad = core.submit(GenerateRequest(id="bad", prompt="Hi", stream=True),
                      lambda out: got.setdefault("bad", []).append(out))
    good = core.submit(GenerateRequest(id="good", prompt="Hi", stream=True),
                       lambda out: got.setdefault("good", []).append(out))

    def explode(ids):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "detokenizer bug")

    core.open[bad].samples[0].detok.push = explode
    core.on_outputs([TokenOutput(f"{bad}/0", [42]), TokenOutput(f"{good}/0", [42])])
    (end,) = got["bad"]
    assert end.finished and end.outputs[0].finish_reason == "error"
    assert end.outputs[0].error_code == 500 and "detokenizer bug" in end.outputs[0].error
    assert isinstance(sent[-1], Abort) and sent[-1].ids == [f"{bad}/0"]
    assert list(core.open) == [good] and not got["good"][0].finished


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(tok):
    counting = _Broken(tok)
    core = FrontendCore(counting, len(tok), 512, "f-", lambda m: None, state=READY)
    limit = core.preparer.max_prompt_chars
    assert 512 * 16 <= limit <= 512 * 200
    with pytest.raises(RequestError, match="more than a context of 512 tokens") as e:
        core.submit(GenerateRequest(id="a", prompt="x" * (limit + 1)), print)
    assert e.value.code == 400 and counting.calls == 0
    with pytest.raises(RequestError, match="more than a context"):
        core.submit(GenerateRequest(id="a", messages=[{"role": "user",
                                                       "content": "x" * limit}]), print)
    assert counting.calls == 0


def test_a_long_prompt_is_tokenized_off_the_event_loop(tok):
    """A prompt that takes a while to tokenize must leave the loop free: a ticker on the same
    loop never waits long while it is tokenized."""
    core = FrontendCore(tok, len(tok), 1 << 20, "f-", lambda m: None, state=READY)
    prompt = "hello world, this is a test. " * 20_000           # 580k characters

    async def main():
        gaps, done = [], False

        async def ticker():
            last = time.monotonic()
            while not done:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        start = time.monotonic()
        rid = await core.submit_async(GenerateRequest(id="a", prompt=prompt), print)
        took = time.monotonic() - start
        done = True
        await tick
        return rid, took, max(gaps)

    rid, took, worst = asyncio.run(main())
    assert rid in core.open and len(core.open[rid].output.prompt_token_ids) > 100_000
    assert took > 0.1 and worst < max(0.1, took / 4), (took, worst)


def test_stats_requests_are_coalesced_into_one_question_to_the_engine(tok):
    sent, answers = [], []
    core = FrontendCore(tok, len(tok), 2048, "f-", sent.append, state=READY)
    for _ in range(10_000):
        core.request_stats(answers.append)
    assert sent == [StatsRequest()]
    stats = Stats(num_running=3)
    core.on_stats(stats)
    assert len(answers) == 10_000 and all(a is stats for a in answers)
    core.request_stats(answers.append)
    assert sent == [StatsRequest(), StatsRequest()]
