"""FrontendCore, the one request path, without an engine: what it refuses and what it delivers."""
import pytest

from conveyor.frontend.core import READY, FrontendCore, RequestError
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.shared.messages.client import GenerateRequest
from conveyor.shared.messages.engine import Abort, AddRequest, TokenOutput
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
    with pytest.raises(RequestError, match="chat template failed") as e:
        core.submit(GenerateRequest(id="a", messages=[{"content": "no role"}]), print)
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
