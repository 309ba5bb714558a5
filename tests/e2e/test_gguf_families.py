"""GGUF files of Gemma 2, Gemma 3 and Phi-3 as llama.cpp's converter writes them
(tests/models_util.py, make_tiny_family_gguf): conveyor's greedy tokens equal transformers' on
the weights the file holds, in F16 and Q8_0, and so do the top-5 logprobs of every position
(the tiny Gemmas tend to repeat one token, which alone would prove little); Q8_0 kept in int8
(--quantization int8) gives the same tokens. Prompts run past Gemma's window of 8 and stay below
Phi-3's LongRoPE switch (64, where transformers re-encodes the whole sequence: README,
"Models"). And the config keys that llama.cpp derives rather than stores, derived as it does."""
import gguf
import pytest
import torch
from models_util import make_tiny_family_gguf

from conveyor import LLM, SamplingParams
from conveyor.shared.model_config import ModelConfig
from conveyor.shared.model_files import gguf_to_hf_config

# what a real GGUF can hold: llama.cpp derives Gemma 2's query_pre_attn_scalar from the size
# (head_dim below 27B, not the preset's 24) and fixes Gemma 3's pattern at five sliding layers
# to one global (6 layers: the last global, with the preset's linear rope scaling)
CARRIED = {"gemma2": {"query_pre_attn_scalar": 16},
           "gemma3": {"sliding_window_pattern": 6, "num_hidden_layers": 6},
           "phi3": {}}
NEW_TOKENS = 10


@pytest.mark.parametrize("quant", ["F16", "Q8_0"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_gguf_family_matches_transformers(tmp_path, arch, quant):

    path = make_tiny_family_gguf(arch, tmp_path / f"{arch}.{quant}.gguf", tmp_path / "ref",
                                 quant, **CARRIED[arch])
    _, outs = run_the_file(path, tmp_path / "ref")
    if quant != "Q8_0":
        return
    int8 = kept_int8(path, outs)
    layers = int8.runner.model_config.num_hidden_layers
    assert len(int8.quantization_report.prequantized) == 4 * layers   # qkv, o, gate_up, down
    qkv = int8.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape[1] == 64 // 32


# prompts past the windows (8) and gpt-oss's YaRN context (32); min_tokens masks EOS as the
# reference's min_new_tokens does
_G = torch.Generator().manual_seed(2)
PROMPTS = [torch.randint(3, 256, (n,), generator=_G).tolist() for n in (5, 23, 41)]
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                        ignore_eos=True, logprobs=5, prompt_logprobs=5)


def run_the_file(path, ref_dir) -> tuple[LLM, list]:
    """The GGUF file's model on PROMPTS, its outputs checked against transformers on the
    weights the file holds (`assert_matches_the_file`): (the LLM, its outputs)."""
    llm = LLM(str(path), device="cpu", skip_tokenizer_init=True, block_size=4)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_matches_the_file(outs, PROMPTS, ref_dir)
    return llm, outs


def kept_int8(path, outs) -> LLM:
    """The file's Q8_0 weights kept in int8 (--quantization int8): the same outputs as `outs`
    (the file dequantized). Returns its LLM."""
    int8 = LLM(str(path), device="cpu", skip_tokenizer_init=True, block_size=4,
               quantization="int8")
    assert_same_outputs(outs, int8.generate(PROMPTS, PARAMS, use_tqdm=False))
    return int8


def assert_matches_the_file(outs, prompts, ref_dir) -> None:
    """Greedy tokens equal transformers' on the weights the file holds (`ref_dir`), and each
    position's top-5 logprobs too (prompt and output)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    for p, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long)
                                )[0, len(p):].tolist()
            logprobs = ref(torch.tensor([p + got])).logits[0].log_softmax(-1)   # [T, vocab]
        assert got == want
        for row, position in zip(logprobs, positions(out)):
            assert all(abs(lp.logprob - row[t].item()) < 2e-4 for t, lp in position.items())


def assert_same_outputs(outs, others) -> None:
    """The same tokens, and each position's top logprobs within 1e-4 (Q8_0 kept int8 against
    the same file dequantized)."""
    for a, b in zip(outs, others):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for pa, pb in zip(positions(a), positions(b)):
            assert set(pa) == set(pb)
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def positions(out) -> list[dict]:
    """The top logprobs of every position after the first: the prompt's, then the output's."""
    return out.prompt_logprobs[1:] + out.outputs[0].logprobs


def write_metadata(path, arch: str, layers: int, window: int | None = None,
                   rope_factors: bool = False, original: int | None = None) -> dict:
    """A GGUF of `arch` with the shape keys only (hidden 64, 4 heads of 32; `original`: the
    context LongRoPE was trained on), as the HF config conveyor reads from it."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_key_length(32)
    w.add_vocab_size(256)
    if window is not None:
        w.add_sliding_window(window)
    if original is not None:
        w.add_rope_scaling_orig_ctx_len(original)
    if rope_factors:
        for kind, first in (("long", 2.0), ("short", 1.0)):
            w.add_tensor(f"rope_factors_{kind}.weight", torch.arange(first, first + 4).numpy())
    w.add_tensor("token_embd.weight", torch.zeros(256, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_to_hf_config(path)


def test_gguf_config_derives_what_llama_cpp_does(tmp_path):
    # the 27B sizes scale attention by (hidden / heads)^-0.5, the others by head_dim^-0.5
    assert write_metadata(tmp_path / "a.gguf", "gemma2", 46)["query_pre_attn_scalar"] == 16
    small = write_metadata(tmp_path / "b.gguf", "gemma2", 26)
    assert small["query_pre_attn_scalar"] == 32
    # Gemma 2 keys a file may lack: llama.cpp's window and soft-caps
    assert (small["sliding_window"], small["attn_logit_softcapping"],
            small["final_logit_softcapping"]) == (4096, 50.0, 30.0)
    assert write_metadata(tmp_path / "c.gguf", "gemma3", 62)["query_pre_attn_scalar"] == 16
    # Gemma 3: five sliding layers to one global; without a window, all global
    cfg = ModelConfig.from_hf(write_metadata(tmp_path / "d.gguf", "gemma3", 12, window=512))
    assert cfg.layer_windows == ((512,) * 5 + (0,)) * 2
    assert cfg.extra["rope_local_base_freq"] == 10000.0
    unwindowed = write_metadata(tmp_path / "e.gguf", "gemma3", 12)
    assert ModelConfig.from_hf(unwindowed).layer_windows == ()
    # Phi-3: a rotary share from rope.dimension_count; LongRoPE factors need the original length
    assert write_metadata(tmp_path / "f.gguf", "phi3", 2)["partial_rotary_factor"] == 1.0
    assert write_metadata(tmp_path / "g.gguf", "phi3", 2, rope_factors=True, original=64
                          )["rope_scaling"] == {"rope_type": "longrope",
                                                "long_factor": [2.0, 3.0, 4.0, 5.0],
                                                "short_factor": [1.0, 2.0, 3.0, 4.0]}
    with pytest.raises(ValueError, match="original_context_length"):
        write_metadata(tmp_path / "h.gguf", "phi3", 2, rope_factors=True)
