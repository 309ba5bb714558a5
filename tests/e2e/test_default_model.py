"""The default model (SmolLM2-135M-Instruct, GGUF) against transformers loading the same file."""
import pytest
import torch

from conveyor import SamplingParams
from conveyor.shared.model_files import default_model_path

pytestmark = pytest.mark.skipif(not default_model_path().is_file(),
                                reason="default model not fetched (make model)")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers(llm, hf_default_model):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_default_model, ids, 24), prompt
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids,
                                                           skip_special_tokens=True)


def test_chat_matches_transformers(llm, hf_default_model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = llm.tokenizer.encode(ids, add_special_tokens=False)
    expected = hf_greedy(hf_default_model, ids, 40)
    eos = llm.tokenizer.eos_token_id
    expected = expected[:expected.index(eos) + 1] if eos in expected else expected
    assert out.outputs[0].token_ids == expected
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_metrics_and_order(llm):
    outs = llm.generate(["a", "b c d e f g"], SamplingParams(temperature=0, max_tokens=5),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["a", "b c d e f g"]
    m = outs[1].metrics
    assert m.time_to_first_token is not None and m.time_to_first_token > 0
    assert m.time_per_output_token is not None and m.time_per_output_token >= 0
    assert outs[0].finished and outs[1].finished
