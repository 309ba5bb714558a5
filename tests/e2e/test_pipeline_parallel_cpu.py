"""Pipeline parallelism on CPU (gloo): `conveyor serve --pp 2` and `--pp 2 --tp 2`, through the
ZMQ client, give the same greedy tokens as one process (the in-process engine) and as
transformers. A tiny random Llama of 5 layers: stage 0 holds layers 0-2 and stage 1 layers 3-4
(the uneven split), and at TP 2 each stage is a tensor-parallel pair. float32 everywhere, so the
tokens must be equal (test_tp_cpu.py says why TP moves logits only by ~1e-7).
"""
import asyncio
import contextlib
import re

import pytest
import torch
from models_util import make_tiny_model
from serve_util import start_server

from conveyor import LLM, SamplingParams
from conveyor.client import AsyncClient

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=128, vocab_size=250, max_position_embeddings=512,
             num_hidden_layers=5)
PROMPTS = [[5, 17, 200, 31], list(range(40, 77)), [9] * 3 + list(range(100, 120)), [249, 0, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(max_num_seqs=64, kv_cache_memory_bytes=64 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def llama5(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama5"), **SHAPE))


def one_process(path: str, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    llm = LLM(model=path, skip_tokenizer_init=True, device="cpu", **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def served(path: str, *args: str, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    from conveyor.client import Client

    device = () if "--device" in args else ("--device", "cpu")   # gloo unless told
    server = start_server("--model", path, "--skip-tokenizer-init", "--port", "-1", *device,
                          *args)
    try:
        with Client(server.addresses[0], timeout=60) as client:
            return [r.outputs[0].token_ids for r in client.generate(prompts, params)]
    finally:
        server.kill_all()


def test_pp2_and_pp2_x_tp2_match_one_process_and_transformers(llama5):
    from transformers import AutoModelForCausalLM

    reference = one_process(llama5)
    hf = AutoModelForCausalLM.from_pretrained(llama5, dtype=torch.float32).eval()
    with torch.no_grad():
        for ids, tokens in zip(PROMPTS, reference):
            out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                              do_sample=False, attention_mask=torch.ones(1, len(ids),
                                                                         dtype=torch.long),
                              eos_token_id=None, pad_token_id=0)
            assert out[0, len(ids):].tolist() == tokens
    assert served(llama5, "--pp", "2") == reference
    assert served(llama5, "--pp", "2", "--tp", "2") == reference


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_families_at_pp2(tmp_path, arch):
    """Qwen3's tied embeddings (the last stage loads the embedding as its LM head) and Gemma 2's
    own decoder (3 layers: 2 + 1, the scaled embedding on the first stage only)."""
    path = str(make_tiny_model(arch, tmp_path / arch, max_position_embeddings=512))
    assert served(path, "--pp", "2") == one_process(path)


def test_arrivals_preemption_and_abort_under_pp2(llama5):
    """A KV pool too small for the load (each stage holds 20 blocks of 4 tokens), requests
    arriving while micro-batches are in flight, and one aborted mid-stream: the others' tokens
    are one process's, every block comes back and the bookkeeping holds."""
    prompts = [[(13 * i + j) % 240 + 3 for j in range(14 + i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = one_process(llama5, prompts, params)
    server = start_server("--model", llama5, "--skip-tokenizer-init", "--port", "-1",
                          "--pp", "2", "--num-kv-blocks", "20", "--block-size", "4",
                          "--max-num-seqs", "8", "--device", "cpu")

    async def run():
        client = AsyncClient(server.addresses[0])
        try:
            first = asyncio.gather(*(client.generate(p, params) for p in prompts[:4]))
            victim = []
            async with contextlib.aclosing(client.stream([7] * 20, params)) as stream:
                async for out in stream:                 # the others are in flight by now
                    victim += out.outputs[0].token_ids
                    if len(victim) >= 3:
                        break                            # leaving aborts it
            later = asyncio.gather(*(client.generate(p, params) for p in prompts[4:]))
            outs = await first + await later
            await asyncio.sleep(0.2)
            return [o.outputs[0].token_ids for o in outs], await client.stats()
        finally:
            client.close()

    try:
        tokens, stats = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        server.kill_all()
    assert tokens == reference
    assert stats.num_preemptions > 0
    assert stats.integrity_ok and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks == 20


def test_structured_outputs_at_pp2():
    """The grammar matchers live beside the sampler, on the last stage: the default model's
    constrained outputs hold at PP 2."""
    from conveyor.client import Client
    from conveyor.shared.structured_outputs import StructuredOutputs

    choice = SamplingParams(temperature=0.8, seed=2, max_tokens=20,
                            structured_outputs=StructuredOutputs(choice=["banana split",
                                                                         "apple pie"]))
    regex = SamplingParams(temperature=0.8, seed=1, max_tokens=30,
                           structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{4}"))
    server = start_server("--pp", "2", "--port", "-1", "--frontends", "1", "--device", "cpu")
    try:
        with Client(server.addresses[0], timeout=120) as client:
            chosen = [o.outputs[0].text for o in client.generate(
                ["My favourite dessert is", "Pick one:", "Dessert?"], choice)]
            text = client.generate("Code:", regex).outputs[0].text
    finally:
        server.kill_all()
    assert set(chosen) <= {"banana split", "apple pie"}, chosen
    assert re.fullmatch(r"[0-9]{3}-[a-z]{4}", text), text


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pp2_on_two_gpus_matches_one_gpu(llama5):
    """NCCL between the stages, each stage eager; float32, so the tokens must be equal."""
    llm = LLM(model=llama5, skip_tokenizer_init=True, device="cuda", dtype="float32",
              max_model_len=512, enforce_eager=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert served(llama5, "--pp", "2", "--device", "cuda", "--dtype", "float32") == reference
