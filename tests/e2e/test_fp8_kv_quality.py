"""fp8 KV cache quality on the default model (SmolLM2-135M-Instruct): the perplexity of a fixed
text through prompt logprobs with kv_cache_dtype="fp8" within 2 % of the model-dtype cache, and
greedy decoding (which reads every earlier token back from the fp8 pool) close to the unquantized
run: equal tokens, or at the first divergence each side's token in the other's top 5.

The prompt is prefilled in 64-token chunks, so each chunk attends to the earlier chunks from the
pool (both backends also read a chunk's own new K/V back from the pool). On CPU the model runs in
float32; the GPU tests compare bfloat16 against fp8 and decode under CUDA graphs, on the default
model where its file is present and on a random Llama-3.1-8B-shaped model (4 layers) built there.
"""
import gc
import math

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.shared.model_files import default_model_path

needs_default_model = pytest.mark.skipif(not default_model_path().is_file(),
                                         reason="default model not fetched (make model)")

TEXT = (
    "The lighthouse stood at the end of a narrow spit of land, where the river met the sea. "
    "For more than a century its keepers climbed the spiral stairs every evening to light the "
    "lamp, and every morning they wrote the weather, the ships that passed and the state of the "
    "tide into a thick leather book. When the lamp was finally automated, the last keeper moved "
    "to the village and opened a small shop that sold coffee, maps and fishing hooks. Visitors "
    "still ask him about the storms. He tells them about the winter when the waves broke over "
    "the gallery, forty metres above the water, and the glass of the lantern cracked but held. "
    "He tells them about the fog that lasted eleven days, when the horn sounded every thirty "
    "seconds and nobody in the village slept. Most of all he tells them about the quiet nights, "
    "when the beam swept across a flat sea and the only sound was the clock that turned the "
    "lens.\n\n"
    "def moving_average(values, window):\n"
    "    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n\n"
    "In 1969 the first crewed landing on the Moon took place; about 650 million people watched "
    "it on television. The Apollo programme cost roughly 25 billion dollars at the time."
)
GREEDY_PROMPTS = ["The history of the lighthouse begins", "def quicksort(xs):",
                  "Water boils at 100 degrees Celsius, and"]
NEW, TOP = 24, 5


def perplexity(llm: LLM, text) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([text], params, use_tqdm=False)[0]
    lps = [pos[tok].logprob for tok, pos in zip(out.prompt_token_ids[1:],
                                                out.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps)), len(lps)


def run(device: str, kv_cache_dtype: str, text, prompts, top: int = TOP, **model) -> dict:
    llm = LLM(device=device, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=64,
              enable_prefix_caching=False, max_num_seqs=4, max_model_len=1024,
              gpu_memory_utilization=0.3, **model)
    pool_dtype = llm.runner.kv_caches[0].dtype
    ppl, n = perplexity(llm, text)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=top)
    greedy = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(pool_dtype=pool_dtype, ppl=ppl, tokens=n, greedy=greedy)


def check_quality(device: str, text=TEXT, prompts=GREEDY_PROMPTS, bound: float = 0.02,
                  top: int = TOP, **model) -> None:
    auto, fp8 = (run(device, dtype, text, prompts, top, **model) for dtype in ("auto", "fp8"))
    assert fp8["pool_dtype"] == torch.float8_e4m3fn and auto["pool_dtype"] != fp8["pool_dtype"]
    assert auto["tokens"] >= 300, "the text should be a few hundred tokens"
    rel = fp8["ppl"] / auto["ppl"] - 1
    print(f"{device}: perplexity {auto['ppl']:.4f} ({auto['pool_dtype']}) vs {fp8['ppl']:.4f} "
          f"(fp8), {100 * rel:+.3f} % over {auto['tokens']} tokens")
    assert fp8["ppl"] != auto["ppl"], "the fp8 pool was never read"
    assert abs(rel) < bound
    for prompt, a, b in zip(prompts, auto["greedy"], fp8["greedy"]):
        for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                la, lb = a.logprobs[j], b.logprobs[j]
                print(f"first divergence at token {j}: auto's token ranks "
                      f"{lb[x].rank if x in lb else f'> {top}'} under fp8, fp8's "
                      f"{la[y].rank if y in la else f'> {top}'} under auto; auto's top "
                      f"{top} span {la[x].logprob - min(v.logprob for v in la.values()):.3f}")
                assert x in lb and y in la, (
                    f"{prompt!r}: first divergence at token {j}: {x} (auto) vs {y} (fp8)")
                break


@needs_default_model
def test_fp8_kv_cache_quality_cpu():
    check_quality("cpu")


@needs_default_model
@pytest.mark.gpu
def test_fp8_kv_cache_quality_gpu():
    check_quality("cuda")


@pytest.mark.gpu
@pytest.mark.slow
def test_fp8_kv_cache_quality_random_llama_gpu(tmp_path):
    """No checkpoint on the GPU machine: a random model; the text is its own greedy
    continuation of a fixed prompt. A wrong scale or a misread fp8 tile moves the perplexity far
    past 2 %.

    NOTE: HF's init (0.02), not the wider 0.05 of test_gpu_models: at 0.05 and hidden 4,096 q
    and k have a std of about 3, attention logits a std of about 10, and e4m3's 3 mantissa bits
    in K then shift such near-one-hot attention more than a trained model's. (Measured on CPU
    with the tiny test models, models_util: hidden 64 at init 0.2 lose 4.7 %; hidden 256 at
    init 0.02 or 0.05, 0.2 %.) On the H200 this model measured +3.3 % (2026-11-30), so its
    bound is 5 %: the issue's 2 % is for the default model, which meets it on CPU (+0.5 %);
    a wrong scale or a misread tile costs far more than 5 %.

    At the first divergence of greedy decoding each side's token must be in the other's top 20,
    not 5: this model's top logprobs are flat (the top 20 span 0.6-1.3 nats, the top 5 about
    0.15), so fp8's rounding reorders them; measured on the H200, each side's token ranked 2 to
    7 in the other's list (8 divergences, two runs)."""
    from benchmarks.models import build_random_model

    path = build_random_model("llama3.1-8b", tmp_path / "llama", num_hidden_layers=4)
    model = dict(model=str(path), skip_tokenizer_init=True)
    prompt = torch.randint(3, 10000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(device="cuda", max_model_len=1024, gpu_memory_utilization=0.3, **model)
    cont = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    check_quality("cuda", prompt + cont, [prompt, prompt[:7], list(range(500, 530))], bound=0.05,
                  top=20, **model)
