"""Quantized models end to end: the default model's perplexity on a fixed text (through prompt
logprobs) with int8 and fp8 weights against the unquantized model, on CPU (the torch reference
paths) and on the GPU (the kernels); a GGUF Q8_0 model kept in int8 gives the tokens and
logprobs of the same file dequantized."""
import math

import pytest
import torch
from models_util import make_tiny_gguf, make_tiny_moe_gguf

from conveyor import LLM, SamplingParams
from conveyor.shared.model_files import default_model_path

needs_model = pytest.mark.skipif(not default_model_path().is_file(),
                                 reason="default model not fetched (make model)")

# ~350 tokens of plain English prose, written for this test
TEXT = """\
The river starts in the hills north of the town, where snow melts slowly through the spring \
and feeds a dozen small streams. By the time it reaches the old mill it is wide enough for a \
rowing boat, and in summer children swim in the deep pool below the weir. The mill itself \
stopped grinding grain more than a century ago. For a while it made paper, then it stood empty, \
and now it holds a small museum that explains how water once powered most of the work in the \
valley.
Farmers brought their harvest to the mill in carts pulled by horses. The miller kept a share of \
the flour as payment, and the rest went back to the farms or on to the market in the next town. \
A good miller knew how to set the stones so that the flour came out fine but not burnt, and how \
to keep the wheel turning when the river ran low in a dry August.
Today the valley is quieter. A road follows the river, and a railway line crosses it twice on \
stone bridges built in the eighteen sixties. Walkers come at weekends to follow the path from \
the source to the sea, a journey of about forty miles that most people finish in three or four \
days. They stay in small guest houses, eat in village pubs, and complain cheerfully about the \
rain, which falls on roughly half the days of the year.
Scientists study the river too. They count the fish that return each autumn, measure how much \
water flows past a gauge near the bridge, and test samples for the chemicals that run off the \
fields after heavy rain. Their records go back more than fifty years, and they show a river that \
has become cleaner since the factories closed, even as the summers have grown warmer and drier.
"""
# measured on CPU (float32 activations): int8 +0.4 %, fp8 +3.9 % (per-token fp8 activations
# cost most of it); the issue asks int8 within 2 %
BOUND = {"int8": 0.02, "fp8": 0.05}


def perplexity(llm: LLM) -> float:
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) > 300
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    logprobs = [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def check_modes(device: str) -> None:
    ref = perplexity(LLM(device=device))
    for mode, bound in BOUND.items():
        llm = LLM(device=device, quantization=mode)
        report = llm.quantization_report
        assert len(report.quantized) == 4 * llm.runner.model_config.num_hidden_layers
        assert report.kept == ["model.embed_tokens", "lm_head"]
        ppl = perplexity(llm)
        assert abs(ppl / ref - 1) < bound, (mode, ppl, ref)
        del llm


@pytest.mark.slow
@needs_model
def test_default_model_perplexity_cpu():
    check_modes("cpu")


@pytest.mark.gpu
@needs_model
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_model_perplexity_gpu():
    check_modes("cuda")


def test_gguf_q8_0_kept_in_int8_matches_dequantized(tmp_path):
    path = make_tiny_gguf(tmp_path / "tiny.Q8_0.gguf")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 9, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    runs = {}
    for mode in (None, "int8"):
        llm = LLM(str(path), skip_tokenizer_init=True, quantization=mode, block_size=4)
        runs[mode] = llm.generate(prompts, params, use_tqdm=False)
    report = llm.quantization_report
    layers = [f"model.layers.{i}.{m}" for i in range(2) for m in
              ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    assert report.prequantized == layers and report.quantized == []
    assert "kept 8 GGUF Q8_0 layers in int8" in report.summary()
    qkv = llm.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (64 + 2 * 32, 64 // 32)
    for a, b in zip(runs[None], runs["int8"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                          b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert set(pa) == set(pb)
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3-moe", dict(mlp_only_layers=[], moe_intermediate_size=64)),
    ("mixtral", dict(intermediate_size=64, sliding_window=None))])
def test_gguf_moe_matches_transformers(tmp_path, arch, overrides):
    """A mixture of experts as llama.cpp writes it (Qwen3-MoE as "qwen3moe", Mixtral as
    "llama" with experts; each layer's experts stacked in one tensor), Q8_0: greedy tokens
    equal to transformers on the dequantized weights. With --quantization int8 the experts keep
    the file's int8 values and scales of 32 inputs (the router stays in full precision), and
    give the same tokens."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_moe_gguf(arch, tmp_path / "moe.Q8_0.gguf", tmp_path / "ref", **overrides)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 23)]
    # min_tokens masks EOS as the reference's min_new_tokens does
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, ignore_eos=True)
    llm = LLM(str(path), skip_tokenizer_init=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10,
                                do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long)
                                )[0, len(p):].tolist()
        assert got == want
    int8 = LLM(str(path), skip_tokenizer_init=True, quantization="int8")
    mlp = int8.runner.model.model.layers[0].mlp
    assert mlp.experts.w13.dtype == torch.int8 and mlp.experts.w13_scale.shape[2] == 64 // 32
    assert mlp.gate.weight.dtype == torch.float32
    assert "model.layers.1.mlp.experts" in int8.quantization_report.prequantized
    assert [o.outputs[0].token_ids for o in int8.generate(prompts, params, use_tqdm=False)] == ours


def test_gguf_q8_0_layers_kept_in_precision_are_dequantized(tmp_path):
    """--keep-precision wins over the file's Q8_0: a matched layer loads dequantized."""
    path = make_tiny_gguf(tmp_path / "tiny.Q8_0.gguf")
    llm = LLM(str(path), skip_tokenizer_init=True, quantization="int8",
              keep_precision=r"lm_head,embed_tokens,layers\.1\.mlp")
    report = llm.quantization_report
    assert report.kept == ["model.embed_tokens", "model.layers.1.mlp.gate_up_proj",
                           "model.layers.1.mlp.down_proj", "lm_head"]
    assert len(report.prequantized) == 6
    down = llm.runner.model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == torch.float32 and down.weight_scale is None


@pytest.mark.slow
@needs_model
def test_serve_reports_quantization_and_matches_in_process():
    """The worker's report reaches the launcher's output, and the server's int8 tokens are the
    in-process engine's."""
    import os
    import re
    import signal
    import threading

    from serve_util import SMALL, run_serve

    from conveyor.client import Client

    prompts = ["The capital of France is", "1, 2, 3,", "def fib(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    proc = run_serve(*SMALL, "--quantization", "int8")
    # NOTE: plain blocking reads (select() cannot see lines already in the pipe's text buffer);
    # a timer kills the server if it never says "serving on"
    timer = threading.Timer(240, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving on" in line:
                break
        timer.cancel()
        assert lines and "serving on" in lines[-1], (lines, proc.stderr.read()[-2000:])
        report = [line for line in lines if "int8: quantized" in line]
        assert len(report) == 1 and "quantized 120 layers" in report[0]
        assert "kept in float32: model.embed_tokens, lm_head" in report[0]
        address = re.search(r"tcp://[\d.]+:\d+", lines[-1]).group(0)
        with Client(address, timeout=120) as client:
            served = [r.token_ids for r in client.generate(prompts, greedy)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    llm = LLM(quantization="int8", max_num_seqs=64, kv_cache_memory_bytes=64 << 20,
              max_model_len=512)
    assert served == [o.outputs[0].token_ids for o in llm.generate(prompts, greedy,
                                                                   use_tqdm=False)]


GPU_PROMPTS = [[5, 100, 2000, 31, 7, 999, 4242, 17, 256, 3000], list(range(300, 341)),
               [9] * 3 + list(range(1000, 1150))]


def quantize_hf_linears(model, mode: str) -> None:
    """Make transformers' linear layers (not the LM head) compute what ours should: the same
    per-row quantized weights, through our torch reference of the mode."""
    from conveyor.kernels.fp8_gemm import fp8_gemm_ref
    from conveyor.kernels.int8_gemm import int8_gemm_ref
    from conveyor.worker.layers.quantization import quantize_weight

    ref = int8_gemm_ref if mode == "int8" else fp8_gemm_ref
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            q, s = quantize_weight(module.weight.data, mode)
            module.forward = lambda x, q=q, s=s, b=module.bias: ref(
                x.reshape(-1, x.shape[-1]), q, s, b).reshape(*x.shape[:-1], -1)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_llama_shape_greedy_matches_quantized_transformers(mode, tmp_path):
    """A Llama-3.1-8B-shaped random model (4 layers: the real GEMM shapes) with CUDA graphs:
    our quantized greedy tokens against transformers running the same quantized weights through
    the torch references; equal, or at the first divergence each side's token is in the other's
    top 5. The three prompts decode together (M = 3, padded to 4: the batched kernels); then
    one prompt alone (M = 1: the skinny GEMV, W8A16 for fp8 too, so only int8 compares there)."""
    import gc

    from transformers import AutoModelForCausalLM

    from benchmarks.models import build_random_model

    path = build_random_model("llama3.1-8b", tmp_path / "llama", num_hidden_layers=4,
                              initializer_range=0.05)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    quantize_hf_linears(ref, mode)
    cases = [GPU_PROMPTS] + ([GPU_PROMPTS[:1]] if mode == "int8" else [])
    expected = []
    with torch.inference_mode():
        for p in GPU_PROMPTS:
            out = ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=16,
                               min_new_tokens=16, do_sample=False, output_scores=True,
                               return_dict_in_generate=True, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), device="cuda",
                                                         dtype=torch.long))
            expected.append((out.sequences[0, len(p):].tolist(),
                             [s[0].float().topk(5).indices.tolist() for s in out.scores]))
    del ref
    torch.cuda.empty_cache()
    llm = LLM(model=str(path), device="cuda", skip_tokenizer_init=True, max_num_seqs=8,
              max_model_len=512, gpu_memory_utilization=0.5, quantization=mode)
    assert len(llm.quantization_report.quantized) == 16
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    for prompts in cases:
        for (hf_tokens, hf_tops), out in zip(expected, llm.generate(prompts, params,
                                                                    use_tqdm=False)):
            tokens = out.outputs[0].token_ids
            for j, (a, b) in enumerate(zip(tokens, hf_tokens)):
                if a != b:
                    assert a in hf_tops[j] and b in out.outputs[0].logprobs[j], (mode, j)
                    break
    del llm.engine, llm.runner
    gc.collect()
    torch.cuda.empty_cache()
