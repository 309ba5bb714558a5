"""Multi-LoRA against transformers + peft: adapters made and saved by peft (random A, non-zero
B) on a tiny random Llama; greedy tokens through conveyor equal peft's for each adapter alone,
for one batch mixing several adapters and the base model, with fewer device slots than adapters
(LRU swapping), and with the prefix cache on (an adapter never reuses another's KV).
"""
import pytest
import torch
from models_util import make_tiny_adapter, make_tiny_model, peft_model

from conveyor import LLM, LoRARequest, SamplingParams

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [[5, 17, 200, 31, 9, 9, 40], list(range(40, 77)), [249, 0, 1], [3] * 20]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base folder, {name: adapter folder}): four adapters of different ranks, scales and
    targets (one rsLoRA, one on attention only, one on the MLP only)."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model("llama", root / "base", max_position_embeddings=512)
    specs = {"all": dict(r=8, alpha=16), "attn": dict(r=4, alpha=8, targets=("q_proj",
                                                                             "v_proj", "o_proj")),
             "mlp": dict(r=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj")),
             "rs": dict(r=2, alpha=4, use_rslora=True, targets=("k_proj", "q_proj", "down_proj"))}
    adapters = {name: make_tiny_adapter(base, root / name, seed=i, **spec)
                for i, (name, spec) in enumerate(specs.items())}
    return base, adapters


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def expected(models):
    """{adapter name or None: greedy tokens of each prompt} from transformers (+ peft)."""
    from transformers import AutoModelForCausalLM

    base, adapters = models
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    out = {None: [hf_greedy(hf, p, NEW) for p in PROMPTS]}
    for name, path in adapters.items():
        model = peft_model(base, path)
        out[name] = [hf_greedy(model, p, NEW) for p in PROMPTS]
        assert out[name] != out[None]          # the adapter changes the output
    return out


def lora_requests(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in
            enumerate(adapters.items())}


def make_llm(base, **kw) -> LLM:
    return LLM(str(base), skip_tokenizer_init=True, block_size=4, enable_lora=True,
               **{"max_lora_rank": 16, **kw})


def test_each_adapter_alone_matches_peft(models, expected):
    base, adapters = models
    llm = make_llm(base, max_loras=1)
    for name, lora in lora_requests(adapters).items():
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
        assert [o.outputs[0].token_ids for o in outs] == expected[name], name
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[None]


@pytest.fixture(params=["stacked", "shrink"])
def shrink_path(request, monkeypatch):
    """Both ways to the shrink (layers/lora.py): A stacked under the base weight (forced: the
    tiny model's layers are too narrow for the default share) or the shrink on x."""
    from conveyor.worker.layers import lora

    monkeypatch.setattr(lora, "STACK_MAX_SHARE", float("inf") if request.param == "stacked"
                        else 0.0)
    return request.param


def _stacked(llm) -> set[bool]:
    return {layer.lora.stacked is not None for layer in llm.runner.lora.layers.values()}


@pytest.mark.parametrize("max_loras,async_scheduling", [(4, True), (2, True), (2, False)])
def test_mixed_batch_matches_peft(models, expected, max_loras, async_scheduling, shrink_path):
    """Every prompt under every adapter and the base, interleaved, in one generate call: with
    4 slots one step holds all of them; with 2, requests wait for a slot and adapters are
    swapped in and out (LRU, on the device and in the host cache alike). Either way to the
    shrink."""
    base, adapters = models
    llm = make_llm(base, max_loras=max_loras, max_cpu_loras=max_loras,
                   async_scheduling=async_scheduling, max_num_seqs=4)
    loras = [None, *lora_requests(adapters).values()]
    pairs = [(p, i, lora) for i, p in enumerate(PROMPTS) for lora in loras]
    outs = llm.generate([p for p, _, _ in pairs], GREEDY, use_tqdm=False,
                        lora_request=[lora for _, _, lora in pairs])
    got = [o.outputs[0].token_ids for o in outs]
    want = [expected[None if lora is None else lora.lora_name][i] for _, i, lora in pairs]
    assert got == want
    assert _stacked(llm) == {shrink_path == "stacked"}
    manager = llm.runner.lora
    if max_loras < len(adapters):
        assert manager.num_loads > len(adapters)     # adapters were evicted and loaded again
    else:
        assert manager.num_loads == len(adapters)
    assert len(manager.resident) <= max_loras and len(manager.host) <= max_loras


def test_speculation_under_adapters_matches_peft(models, expected):
    """Each prompt under another adapter (or the base) with speculative decoding: the guesses
    (from peft's own outputs, every third one wrong) are verified by the adapted model, several
    query tokens a sequence, so the tokens are still peft's."""
    from types import SimpleNamespace

    from test_speculative import NGRAM, OracleProposer

    base, adapters = models
    loras = [None, *lora_requests(adapters).values()]
    pairs = [(p, lora) for p, lora in zip(PROMPTS, loras)]
    want = [expected[None if lora is None else lora.lora_name][i]
            for i, (_, lora) in enumerate(pairs)]
    llm = make_llm(base, max_loras=2, speculative_config=NGRAM)
    llm.runner.draw.proposer = OracleProposer([SimpleNamespace(
        prompt_token_ids=p, outputs=[SimpleNamespace(token_ids=w)])
        for (p, _), w in zip(pairs, want)])
    outs = llm.generate([p for p, _ in pairs], GREEDY, use_tqdm=False,
                        lora_request=[lora for _, lora in pairs])
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.engine.scheduler.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens >= 8


def test_prefix_cache_is_per_adapter(models, expected):
    """The same prompt under two adapters and the base, one after the other with the prefix
    cache on: each run computes its own KV (a shared block would change the tokens)."""
    base, adapters = models
    llm = make_llm(base, max_loras=2, enable_prefix_caching=True)
    loras = lora_requests(adapters)
    for lora in (None, loras["all"], loras["mlp"], None, loras["all"]):
        [out] = llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False, lora_request=lora)
        assert out.outputs[0].token_ids == expected[
            None if lora is None else lora.lora_name][3]
    # the repeats hit the cache of their own adapter
    assert out.metrics.num_cached_tokens > 0


def test_bad_adapters_are_refused_and_lose_nothing(models, expected, tmp_path):
    base, adapters = models
    llm = make_llm(base, max_lora_rank=8, max_loras=1)
    loras = lora_requests(adapters)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras["all"])
    assert [o.outputs[0].token_ids for o in outs] == expected["all"]
    too_big = LoRARequest("mlp", 3, str(adapters["mlp"]))                 # rank 16 > 8
    with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank 8"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=too_big)
    other = make_tiny_model("llama", tmp_path / "other", hidden_size=32, head_dim=8)
    wrong = make_tiny_adapter(other, tmp_path / "wrong", r=4)
    with pytest.raises(ValueError, match="shape"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("w", 9,
                                                                                str(wrong)))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{")
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="unreadable"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("b", 10, str(tmp_path / "broken")))
    with pytest.raises(ValueError, match="already used"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("again", 1, str(adapters["attn"])))
    # the engine is intact: the base and a good adapter still give the right tokens
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras["all"])
    assert [o.outputs[0].token_ids for o in outs] == expected["all"]
    assert llm.engine.stats().integrity_ok
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[None]


def test_an_mlp_without_a_gate_takes_adapters(tmp_path):
    """Arcee's up_proj stands alone (UpDownMLP, no gate_up_proj): an adapter on it, down_proj,
    q and v gives peft's tokens."""
    base = make_tiny_model("arcee", tmp_path / "arcee", max_position_embeddings=512)
    adapter = make_tiny_adapter(base, tmp_path / "a",
                                targets=("q_proj", "v_proj", "up_proj", "down_proj"))
    want = [hf_greedy(peft_model(base, adapter), p, NEW) for p in PROMPTS]
    outs = make_llm(base, max_loras=1).generate(PROMPTS, GREEDY, use_tqdm=False,
                                                lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_lora_needs_enable_lora(models):
    base, adapters = models
    llm = LLM(str(base), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("all", 1, str(adapters["all"])))


# --- served: HTTP, the ZMQ client, runtime loading, tensor parallel -------------------------

def _completion(server, model: str, prompt: list[int]):
    import httpx

    return httpx.post(server.http + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True})


@pytest.mark.slow
def test_served_adapters_over_http_and_zmq(models, expected, tmp_path):
    """/v1/models lists the adapters under the base; a completion names its adapter as its
    model; adapters load and unload at run time; bad ones get a 400 and the server goes on."""
    import httpx
    from serve_util import start_server

    from conveyor.client import Client

    base, adapters = models
    server = start_server("--model", str(base), "--skip-tokenizer-init", "--enable-lora",
                          "--max-loras", "2", "--lora-modules", f"all={adapters['all']}",
                          f"attn={adapters['attn']}", "--allow-runtime-lora-updating",
                          "--served-model-name", "tiny")
    try:
        listed = httpx.get(server.http + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [
            ("tiny", None), ("all", "tiny"), ("attn", "tiny")]
        for model, name in (("tiny", None), ("all", "all"), ("attn", "attn")):
            r = _completion(server, model, PROMPTS[0])
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[name][0]
        r = _completion(server, "mlp", PROMPTS[0])
        assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]

        load = server.http + "/v1/load_lora_adapter"
        unload = server.http + "/v1/unload_lora_adapter"
        r = httpx.post(load, json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
        assert r.status_code == 200, r.text
        r = _completion(server, "mlp", PROMPTS[1])
        assert r.json()["choices"][0]["token_ids"] == expected["mlp"][1]
        for body, says in (({"lora_name": "mlp", "lora_path": str(adapters["rs"])}, "already"),
                           ({"lora_name": "x", "lora_path": str(tmp_path)}, "not a PEFT"),
                           ({"lora_name": "tiny", "lora_path": str(adapters["rs"])}, "base"),
                           ({"lora_name": "x"}, "lora_path")):
            r = httpx.post(load, json=body)
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert httpx.post(unload, json={"lora_name": "mlp"}).status_code == 200
        assert _completion(server, "mlp", PROMPTS[1]).status_code == 404
        assert httpx.post(unload, json={"lora_name": "mlp"}).status_code == 404

        with Client(server.addresses[0], timeout=60) as client:
            [out] = client.generate([PROMPTS[2]], GREEDY, lora="attn")
            assert out.outputs[0].token_ids == expected["attn"][2]
            [out] = client.generate([PROMPTS[2]], GREEDY)
            assert out.outputs[0].token_ids == expected[None][2]
            with pytest.raises(Exception, match="unknown LoRA adapter 'mlp'"):
                client.generate([PROMPTS[2]], GREEDY, lora="mlp")
        r = _completion(server, "all", PROMPTS[3])            # still serving
        assert r.json()["choices"][0]["token_ids"] == expected["all"][3]
    finally:
        server.kill_all()


@pytest.mark.slow
def test_tp2_shards_adapters_like_the_base(models, expected):
    """--tp 2 on CPU (gloo): column-parallel layers keep B's rows of their heads (q, k, v) or
    features (gate, up), row-parallel ones A's columns (o, down), added before the base's
    all-reduce: the same greedy tokens as transformers + peft, base and adapters mixed."""
    from serve_util import start_server

    from conveyor.client import Client

    base, adapters = models
    server = start_server("--model", str(base), "--skip-tokenizer-init", "--tp", "2",
                          "--port", "-1", "--device", "cpu", "--enable-lora", "--max-loras",
                          "2", "--lora-modules",
                          *[f"{n}={p}" for n, p in adapters.items()])
    try:
        with Client(server.addresses[0], timeout=120) as client:
            for name in ("all", None, "rs", "mlp", "attn"):
                options = {} if name is None else {"lora": name}
                outs = client.generate(PROMPTS, GREEDY, **options)
                assert [o.outputs[0].token_ids for o in outs] == expected[name], name
    finally:
        server.kill_all()


def top5_tokens(model, ids: list[int], n: int) -> tuple[list[int], list[list[int]]]:
    """Greedy tokens and each step's top 5, from transformers (+ peft)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids], device=model.device),
                             max_new_tokens=n, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                       device=model.device))
    return (out.sequences[0, len(ids):].tolist(),
            [s[0].float().topk(5).indices.tolist() for s in out.scores])


def assert_close_to(reference: tuple[list[int], list[list[int]]], out) -> None:
    """Greedy tokens equal, or at the first divergence each side's token in the other's top 5
    (STYLE.md's rule, for runs whose arithmetic differs: quantized weights, bf16)."""
    tokens, tops = reference
    for i, (a, b) in enumerate(zip(tokens, out.token_ids, strict=True)):
        if a != b:
            assert a in out.logprobs[i] and b in tops[i], (i, a, b)
            return


def test_int8_base_with_adapters(models):
    """Weights quantized to int8 (W8A16), adapters in full precision: close to peft on the
    full-precision model, and each adapter still changes the output."""
    base, adapters = models
    loras = lora_requests(adapters)
    llm = make_llm(base, max_loras=2, quantization="int8", keep_precision="")
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for name in ("all", "mlp"):
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras[name])
        assert [o.outputs[0].token_ids for o in outs] != plain
        model = peft_model(base, adapters[name])
        for p, out in zip(PROMPTS, outs):
            assert_close_to(top5_tokens(model, p, NEW), out.outputs[0])


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_mixed_batch_with_cuda_graphs(models, shrink_path):
    """bf16 on the GPU, the Triton kernels, decode and mixed steps replayed from CUDA graphs:
    close to peft in bf16 on the same GPU for each adapter and the base in one batch, and
    token for token what the same engine gives eagerly; either way to the shrink."""
    base, adapters = models
    loras = [None, *lora_requests(adapters).values()]
    pairs = [(p, lora) for p in PROMPTS for lora in loras]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    runs = {}
    for eager in (False, True):
        llm = LLM(str(base), skip_tokenizer_init=True, device="cuda", enable_lora=True,
                  max_loras=4, max_lora_rank=16, enforce_eager=eager, max_model_len=256,
                  gpu_memory_utilization=0.3)
        runs[eager] = llm.generate([p for p, _ in pairs], params, use_tqdm=False,
                                   lora_request=[lora for _, lora in pairs])
        assert _stacked(llm) == {shrink_path == "stacked"}
        del llm
        torch.cuda.empty_cache()
    assert ([o.outputs[0].token_ids for o in runs[False]]
            == [o.outputs[0].token_ids for o in runs[True]])
    from transformers import AutoModelForCausalLM

    hf = {None: AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).cuda().eval()}
    for lora in loras[1:]:
        hf[lora.lora_name] = peft_model(base, adapters[lora.lora_name]).to(
            "cuda", torch.bfloat16).eval()
    for (p, lora), out in zip(pairs, runs[False]):
        assert_close_to(top5_tokens(hf[None if lora is None else lora.lora_name], p, NEW),
                        out.outputs[0])


@pytest.mark.slow
def test_default_model_from_gguf(tmp_path, hf_default_model):
    """SmolLM2-135M from its GGUF file (q and k rows un-permuted at load) with an adapter peft
    made on transformers' load of the same file: the same greedy tokens."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model

    def hf():                                # peft wraps the model it gets in place
        return copy.deepcopy(hf_default_model)

    model = get_peft_model(hf(), LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(hf(), tmp_path / "adapter").eval()
    llm = LLM(enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("smol", 1, str(tmp_path / "adapter"))
    texts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(texts, params, use_tqdm=False, lora_request=lora)
    plain = llm.generate(texts, params, use_tqdm=False)
    for text, out, base in zip(texts, outs, plain):
        ids = llm.tokenizer.encode(text)
        assert out.outputs[0].token_ids == hf_greedy(reference, ids, 12)
        assert out.outputs[0].token_ids != base.outputs[0].token_ids


@pytest.mark.slow
def test_tp2_with_stacked_layers(tmp_path):
    """A model wide enough that A is stacked under W on each rank (one slot of rank 16 adds 48
    rows to the 512 of qkv a rank holds, under STACK_MAX_SHARE), served with --tp 2: the
    row-parallel layers' outputs, strided past the shrink's columns, are reduced like any
    other; the same greedy tokens as transformers + peft."""
    from serve_util import start_server
    from transformers import AutoModelForCausalLM

    from conveyor.client import Client

    base = make_tiny_model("llama", tmp_path / "wide", hidden_size=512, intermediate_size=1024,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                           num_hidden_layers=1, max_position_embeddings=512,
                           initializer_range=0.05)
    adapter = make_tiny_adapter(base, tmp_path / "a", r=8, alpha=16, std=0.05)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    want = {None: [hf_greedy(hf, p, NEW) for p in PROMPTS],
            "a": [hf_greedy(peft_model(base, adapter), p, NEW) for p in PROMPTS]}
    assert want["a"] != want[None]
    one = make_llm(base, max_loras=1)                       # in process, one rank
    assert _stacked(one) == {True}
    del one
    server = start_server("--model", str(base), "--skip-tokenizer-init", "--tp", "2",
                          "--port", "-1", "--device", "cpu", "--enable-lora", "--max-loras",
                          "1", "--lora-modules", f"a={adapter}")
    try:
        with Client(server.addresses[0], timeout=120) as client:
            for name in ("a", None):
                options = {} if name is None else {"lora": name}
                outs = client.generate(PROMPTS, GREEDY, **options)
                assert [o.outputs[0].token_ids for o in outs] == want[name], name
    finally:
        server.kill_all()
