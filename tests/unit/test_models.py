"""Our models and paged attention against Hugging Face transformers and a naive reference."""
from __future__ import annotations

import math
import random
import time

import pytest
import torch
from models_util import MULTIMODAL, make_tiny_model, make_tiny_multimodal

from conveyor.shared.model_files import default_model_path, read_model_config, resolve_model
from conveyor.worker.attention_backend import TorchAttentionBackend
from conveyor.worker.context import StepContext
from conveyor.worker.loader import load_model


class PagedPool:
    """A toy block manager: hands out shuffled blocks and builds each step's StepContext."""

    def __init__(self, num_layers, num_blocks, block_size, kv_heads, head_dim, seed=0):
        gen = torch.Generator().manual_seed(seed)
        # Garbage, not zeros, in unused slots: reading one shows up as a wrong result.
        self.kv_caches = [torch.randn(num_blocks, 2, block_size, kv_heads, head_dim,
                                      generator=gen) for _ in range(num_layers)]
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def fork(self, src: int, dst: int, num_tokens: int) -> None:
        """dst starts with the first num_tokens of src, sharing its full blocks (a prefix hit)."""
        assert num_tokens % self.block_size == 0
        self.tables[dst] = self.tables[src][:num_tokens // self.block_size]
        self.lens[dst] = num_tokens

    def step(self, work: list[tuple[int, int]], num_decodes: int):
        """work: (seq id, number of new tokens) -> positions [T], StepContext."""
        slots, positions, q_lens, seq_lens = [], [], [], []
        for sid, n in work:
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < start + n:
                table.append(self.free.pop())
            for p in range(start, start + n):
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            positions += range(start, start + n)
            q_lens.append(n)
            seq_lens.append(start + n)
            self.lens[sid] = start + n
        width = max(len(self.tables[sid]) for sid, _ in work)
        tables = [self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid, _ in work]
        ctx = StepContext(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                         dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            kv_caches=self.kv_caches, query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
            num_decodes=num_decodes)
        return torch.tensor(positions, dtype=torch.int64), ctx


def pool_for(model, num_blocks=64, block_size=4):
    c = model.config
    return PagedPool(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads,
                     c.head_dim)


def run_step(model, pool, tokens, work, num_decodes):
    """Feed each (sid, n) the last n tokens of tokens[sid]; returns logits rows per sid."""
    positions, ctx = pool.step(work, num_decodes)
    ids = torch.tensor([t for sid, n in work for t in tokens[sid][len(tokens[sid]) - n:]])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, ctx))
    rows = torch.tensor(ctx.query_lens_cpu).cumsum(0).tolist()
    return {sid: logits[end - n:end] for (sid, n), end in zip(work, rows)}


ARCHS = ["llama", "llama-tied", "llama4", "exaone", "internlm3", "qwen2", "qwen3", "mistral",
         "ministral", "ministral3", "smollm3", "gemma", "gemma2", "gemma3", "phi3", "qwen3-moe",
         "qwen3-moe-unnormed", "mixtral", "qwen2-moe", "glm", "glm4", "glm4-moe", "deepseek-v3",
         "glm4-moe-lite", "dots1", "deepseek-v2", "olmo2", "olmo3", "exaone4", "exaone-moe",
         "seed-oss", "granite", "granite-moe", "granite-moe-shared", "cohere", "cohere2",
         "minimax-m2", "ernie4.5", "ernie4.5-moe", "olmoe", "flex-olmo", "hunyuan", "hunyuan-moe",
         "starcoder2", "arcee", "apertus", "gpt-oss"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    built = {}
    for arch in ARCHS:
        path = make_tiny_model(arch, tmp_path_factory.mktemp(arch))
        files = resolve_model(str(path))
        ours = load_model(read_model_config(files), files, torch.float32, "cpu")
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        built[arch] = ours, ref
    return built


@pytest.mark.parametrize("arch", ARCHS)
def test_model_matches_transformers(tiny_models, arch):
    ours, ref = tiny_models[arch]
    gen = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size
    tokens = {sid: torch.randint(3, vocab, (n,), generator=gen).tolist()
              for sid, n in enumerate([1, 5, 13])}
    pool = pool_for(ours)
    worst = 0.0

    def check(out):
        nonlocal worst
        for sid, rows in out.items():
            with torch.no_grad():
                full = ref(torch.tensor([tokens[sid]])).logits[0]
            expected = full[len(tokens[sid]) - rows.shape[0]:]
            worst = max(worst, (rows - expected).abs().max().item())
            torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4)

    out = run_step(ours, pool, tokens, [(0, 1), (1, 5), (2, 13)], num_decodes=0)
    check(out)
    # seq 3 shares seq 2's first 8 tokens (two full blocks) and prefills the rest in two chunks.
    tokens[3] = tokens[2][:8] + torch.randint(3, vocab, (7,), generator=gen).tolist()
    pool.fork(2, 3, 8)
    chunks = [3, 4]      # then seq 3 joins the decodes
    full3, tokens[3] = tokens[3], tokens[3][:8]
    for step in range(4):
        for sid in (0, 1, 2):
            tokens[sid].append(int(out[sid][-1].argmax()))
        work = [(0, 1), (1, 1), (2, 1)]
        if step < 2:
            tokens[3] = full3[:len(tokens[3]) + chunks[step]]
            work.append((3, chunks[step]))
        else:
            tokens[3].append(int(out[3][-1].argmax()))
            work.insert(0, (3, 1))
        out = run_step(ours, pool, tokens, work, num_decodes=len(work) - (step < 2))
        check(out)
    print(f"{arch}: max |logit diff| {worst:.2e}")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(tiny_models, arch):
    """Prompts of 41 tokens (past Mistral's window of 8) prefilled in chunks of 16 beside the
    other sequences' decodes, then 12 greedy tokens each: the same tokens as transformers'
    generate (which stops at the end-of-sequence token: ours are cut there)."""
    ours, ref = tiny_models[arch]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, ours.config.vocab_size, (41,), generator=gen).tolist()
               for _ in range(3)]
    eos = ours.config.eos_token_ids[0]
    got = [t[:t.index(eos) + 1] if eos in t else t for t in greedy(ours, prompts, 12)]
    assert got == hf_greedy(ref, prompts, 12)


def _as_on_the_hub(kind: str, folder, text: dict) -> None:
    """Rewrite a checkpoint transformers saved into the other layout published ones have:
    transformers' newer weight names (`model.language_model.`) and the hub's config.json
    (Gemma 3: a sparse text_config naming only what differs from the defaults; Qwen2.5-VL:
    the text model's keys at the top level, rope_scaling {"type": "mrope"}); Qwen3-VL-MoE's
    published experts are [E, inputs, outputs], and its config says num_experts."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    if kind == "qwen3_vl_moe":
        tensors = {n: t.transpose(1, 2).contiguous() if ".mlp.experts." in n else t
                   for n, t in tensors.items()}
    elif kind == "gemma3":
        tensors = {(n.replace("language_model.model.", "model.language_model.", 1)
                    .replace("vision_tower.", "model.vision_tower.", 1)): t
                   for n, t in tensors.items()}
    else:
        tensors = {(n.replace("model.", "model.language_model.", 1) if n.startswith("model.")
                    else n.replace("visual.", "model.visual.", 1)): t
                   for n, t in tensors.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((folder / "config.json").read_text())
    if kind == "qwen3_vl_moe":
        saved["text_config"]["num_experts"] = saved["text_config"].pop("num_local_experts")
    elif kind == "gemma3":
        sparse = {k: v for k, v in saved["text_config"].items()
                  if k in text or k in ("model_type", "layer_types")}
        saved["text_config"] = {**sparse, "rope_scaling": text["rope_scaling"]}
    else:
        top = {k: v for k, v in saved.pop("text_config").items() if k != "rope_parameters"}
        saved.update(top, rope_theta=1e6, rope_scaling=text["rope_scaling"])
    (folder / "config.json").write_text(json.dumps(saved))


@pytest.mark.parametrize("kind,hub", [("gemma3", False), ("gemma3", True), ("qwen2_5_vl", False),
                                      ("qwen2_5_vl", True), ("qwen3_vl", False),
                                      ("qwen3_vl_moe", False), ("qwen3_vl_moe", True),
                                      ("mistral3", False), ("mistral3:ministral3", False),
                                      ("mistral3:mistral4", False), ("llama4", False)])
def test_multimodal_checkpoint_serves_its_text(tmp_path, kind, hub):
    """gemma-3-4b/12b/27b, Qwen2.5-VL, Qwen3-VL (dense and MoE) and Mistral Small 3.x
    checkpoints, tiny ones made by transformers, served for their text: the language model's
    config (Gemma's sparse text_config takes Gemma3TextConfig's defaults; M-RoPE, interleaved
    or not, is the plain rotation for text) and weights (transformers' older and newer names;
    MoE experts stacked either way round), the vision tower skipped; a text prompt's logits
    and greedy tokens are transformers' own model's."""
    from transformers import AutoModelForImageTextToText

    text, _, _, arch = MULTIMODAL[kind]
    make_tiny_multimodal(kind, tmp_path)
    ref = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    if hub:
        _as_on_the_hub(kind, tmp_path, text)
    files = resolve_model(str(tmp_path))
    config = read_model_config(files)
    assert config.architecture == arch
    # no M-RoPE left (the others' rope_scaling is their own)
    assert kind.startswith(("gemma3", "mistral3:", "llama4")) or config.rope_scaling is None
    ours = load_model(config, files, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 490, (21,), generator=gen).tolist() for _ in range(2)]
    logits = run_step(ours, pool_for(ours), {0: prompts[0]}, [(0, 21)], 0)[0]
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    eos = ours.config.eos_token_ids[0]
    got = [t[:t.index(eos) + 1] if eos in t else t for t in greedy(ours, prompts, 10)]
    assert got == hf_greedy(ref, prompts, 10)


@pytest.mark.parametrize("kind,fmt", [("qwen2_5_vl", "awq"), ("gemma3", "gptq"),
                                      ("mistral3", "w4a16")])
def test_quantized_multimodal_checkpoint_serves_its_text(tmp_path, kind, fmt):
    """A 4-bit multimodal checkpoint (as Qwen2.5-VL-7B-Instruct-AWQ; the vision tower quantized
    too here, and left out): the language model's layers take its words, and its text greedy
    tokens are transformers' on the dequantized weights."""
    from int4_util import write_int4, write_w4a16
    from transformers import AutoModelForImageTextToText

    make_tiny_multimodal(kind, tmp_path / "src")
    if fmt == "w4a16":
        write_w4a16(tmp_path / "src", tmp_path / "q", tmp_path / "ref", 32, symmetric=True)
    else:
        write_int4(tmp_path / "src", tmp_path / "q", tmp_path / "ref", fmt, 32)
    files = resolve_model(str(tmp_path / "q"))
    config = read_model_config(files)
    ours = load_model(config, files, torch.float32, "cpu")
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int32   # 4-bit words
    ref = AutoModelForImageTextToText.from_pretrained(tmp_path / "ref").eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 490, (21,), generator=gen).tolist() for _ in range(2)]
    eos = ours.config.eos_token_ids[0]
    got = [t[:t.index(eos) + 1] if eos in t else t for t in greedy(ours, prompts, 10)]
    assert got == hf_greedy(ref, prompts, 10)


def test_glm_checkpoint_loads_without_its_mtp_layer(tmp_path):
    """GLM-4.5's published checkpoints add a multi-token-prediction layer after the last one
    (model.layers.{num_hidden_layers}: its own projections, norms and a decoder layer), which
    serving leaves out: the model loads, its logits unchanged."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model("glm4-moe", tmp_path / "glm")
    files = resolve_model(str(path))
    config = read_model_config(files)
    plain = load_model(config, files, torch.float32, "cpu")
    tensors = load_file(path / "model.safetensors")
    last = config.num_hidden_layers - 1
    mtp = {name.replace(f"layers.{last}.", f"layers.{last + 1}."): t.clone()
           for name, t in tensors.items() if f"layers.{last}." in name}
    mtp[f"model.layers.{last + 1}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, path / "model.safetensors")
    ours = load_model(config, files, torch.float32, "cpu")
    prompt = list(range(3, 24))
    for model in (plain, ours):
        model.logits = run_step(model, pool_for(model), {0: prompt}, [(0, 21)], 0)[0]
    torch.testing.assert_close(ours.logits, plain.logits, atol=0, rtol=0)


def test_minimax_m2_published_config_rotates_rotary_dim_features(tmp_path):
    """MiniMax-M2's config.json gives its partial rotary embedding as rotary_dim alone (64 of
    128 features), without transformers' partial_rotary_factor: the same model then."""
    import json

    path = make_tiny_model("minimax-m2", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("partial_rotary_factor", None)
    cfg["rope_parameters"].pop("partial_rotary_factor")
    (path / "config.json").write_text(json.dumps(cfg))
    config = read_model_config(resolve_model(str(path)))
    model = load_model(config, resolve_model(str(path)), torch.float32, "cpu")
    assert model.model.rotary_emb.cos.shape[-1] == cfg["rotary_dim"] // 2


@pytest.mark.parametrize("arch", ["dots1", "qwen2"])
def test_windows_without_layer_types_follow_max_window_layers(tmp_path, arch):
    """A config.json without layer_types (as published): the layers from max_window_layers on
    slide, the ones before see everything, as transformers' own layer_types say."""
    import json

    from conveyor.shared.model_config import layer_windows

    extra = {} if arch == "dots1" else {"use_sliding_window": True, "sliding_window": 8,
                                         "max_window_layers": 1}
    cfg = json.loads((make_tiny_model(arch, tmp_path / "m", **extra) / "config.json").read_text())
    want = tuple(8 if t == "sliding_attention" else 0 for t in cfg.pop("layer_types"))
    assert 0 in want and 8 in want
    assert layer_windows(cfg, cfg["architectures"][0]) == want


@pytest.mark.parametrize("arch", ["exaone", "internlm3"])
def test_published_configs_of_llama_relatives_load(tmp_path, arch):
    """EXAONE 3.x's and InternLM3's config.json as published (their own architecture names;
    EXAONE's num_layers, layer_norm_epsilon and activation_function, InternLM3's qkv_bias and
    bias) give the model transformers runs from its own saved config."""
    import json

    from transformers import AutoModelForCausalLM

    path = make_tiny_model(arch, tmp_path / "m")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = json.loads((path / "config.json").read_text())
    if arch == "exaone":
        cfg.update(architectures=["ExaoneForCausalLM"], num_layers=cfg.pop("num_hidden_layers"),
                   layer_norm_epsilon=cfg.pop("rms_norm_eps"),
                   activation_function=cfg.pop("hidden_act"))
    else:
        cfg.update(architectures=["InternLM3ForCausalLM"], qkv_bias=cfg.pop("attention_bias"),
                   bias=cfg.pop("mlp_bias"))
    (path / "config.json").write_text(json.dumps(cfg))
    files = resolve_model(str(path))
    ours = load_model(read_model_config(files), files, torch.float32, "cpu")
    prompts = [[5, 17, 200, 31, 9, 8], list(range(40, 60))]
    assert greedy(ours, prompts, 8) == hf_greedy(ref, prompts, 8)


def test_llama4_config_without_no_rope_layers_takes_every_fourth_layer_as_nope(tmp_path):
    """A Llama 4 config.json without no_rope_layers (transformers then makes every fourth layer
    NoPE): that layer neither rotates nor chunks nor norms q/k, and takes the query scale, as
    transformers' model does from the same file."""
    import json

    from transformers import AutoModelForCausalLM

    path = make_tiny_model("llama4", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("no_rope_layers") == [1, 1, 1, 0]
    (path / "config.json").write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    files = resolve_model(str(path))
    ours = load_model(read_model_config(files), files, torch.float32, "cpu")
    assert ours.model.nope == {3}
    prompts = [list(range(40, 61)), [5, 17, 200, 31, 9, 8, 7, 6, 5, 4]]
    eos = ours.config.eos_token_ids[0]
    got = [t[:t.index(eos) + 1] if eos in t else t for t in greedy(ours, prompts, 8)]
    assert got == hf_greedy(ref, prompts, 8)


def test_a_mistral_repository_loads_its_hugging_face_files_only(tmp_path):
    """Mistral's repositories hold the weights twice: Hugging Face's files (with an index, or
    one model.safetensors) and Mistral's consolidated.safetensors. Only the first are read
    (consolidated's names would be unexpected, and its bytes read twice)."""
    import json

    from safetensors.torch import load_file, save_file

    path = make_tiny_model("mistral", tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)},
              path / "consolidated.safetensors")
    files = resolve_model(str(path))
    load_model(read_model_config(files), files, torch.float32, "cpu")
    names = sorted(tensors)
    (path / "model.safetensors").unlink()                       # sharded, with an index
    for i, part in enumerate((names[:5], names[5:])):
        save_file({n: tensors[n] for n in part}, path / f"model-0000{i + 1}-of-00002.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: f"model-0000{1 + (n not in names[:5])}-of-00002.safetensors" for n in names}}))
    (path / "stale.safetensors").write_bytes((path / "consolidated.safetensors").read_bytes())
    ours = load_model(read_model_config(files), files, torch.float32, "cpu")
    assert torch.equal(ours.model.norm.weight, tensors["model.norm.weight"])
    for f in path.glob("*.safetensors*"):      # an older checkpoint: pickled .bin files only
        f.unlink()
    (path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pytorch_model.*no pickle"):
        load_model(read_model_config(files), files, torch.float32, "cpu")


def greedy(model, prompts, new_tokens, chunk=16, block_size=4):
    """Greedy tokens through the paged path: prefills in chunks of `chunk` while the sequences
    already decoding take one token each (mixed steps)."""
    pool = pool_for(model, num_blocks=sum(-(-(len(p) + new_tokens) // block_size)
                                          for p in prompts) + 4, block_size=block_size)
    tokens = {sid: [] for sid in range(len(prompts))}
    fed = {sid: 0 for sid in tokens}
    while any(len(tokens[s]) < len(prompts[s]) + new_tokens for s in tokens):
        decodes = [s for s in tokens if fed[s] >= len(prompts[s])
                   and len(tokens[s]) < len(prompts[s]) + new_tokens]
        prefills = [s for s in tokens if fed[s] < len(prompts[s])][:1]
        work = [(s, 1) for s in decodes]
        for s in prefills:
            n = min(chunk, len(prompts[s]) - fed[s])
            tokens[s] = prompts[s][:fed[s] + n]
            fed[s] += n
            work.append((s, n))
        out = run_step(model, pool, tokens, work, num_decodes=len(decodes))
        for s, _ in work:
            if fed[s] >= len(prompts[s]):
                tokens[s].append(int(out[s][-1].argmax()))
    return [tokens[s][len(prompts[s]):] for s in sorted(tokens)]


def hf_greedy(ref, prompts, new_tokens):
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = ref.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def naive_attention(q, kv_cache, tables, q_lens, seq_lens, scale, window=0, softcap=0.0,
                    sinks=None, chunk=0):
    """Per sequence, per query: gather its keys position by position; float64 softmax (with
    sinks [heads], over the scores and the head's sink, the sink's column dropped); with a
    chunk, the keys from the start of the query's chunk."""
    bs = kv_cache.shape[2]
    heads, kv_heads = q.shape[1], kv_cache.shape[3]
    out, start = torch.zeros_like(q), 0
    for table, q_len, seq_len in zip(tables, q_lens, seq_lens):
        kv = torch.stack([kv_cache[table[p // bs], :, p % bs] for p in range(seq_len)])
        k = kv[:, 0].double().repeat_interleave(heads // kv_heads, dim=1)   # [S, heads, d]
        v = kv[:, 1].double().repeat_interleave(heads // kv_heads, dim=1)
        for j in range(q_len):
            pos = seq_len - q_len + j
            first = max(0, pos + 1 - window) if window else 0
            if chunk:
                first = pos // chunk * chunk
            scores = torch.einsum("hd,shd->hs", q[start + j].double(), k[first:pos + 1]) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is None:
                probs = scores.softmax(-1)
            else:
                probs = torch.cat([scores, sinks.double()[:, None]], -1).softmax(-1)[:, :-1]
            out[start + j] = torch.einsum("hs,shd->hd", probs, v[first:pos + 1]).float()
        start += q_len
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (3, 1, 12), (5, 5, 16)])
@pytest.mark.parametrize("num_decodes,num_prefills", [(3, 2), (0, 3), (5, 0), (1, 1), (11, 1)])
@pytest.mark.parametrize("window,softcap,sinks,chunk", [
    (0, 0.0, False, 0), (5, 0.0, False, 0), (1, 0.0, False, 0), (6, 1.5, False, 0),
    (0, 0.7, False, 0), (0, 0.0, True, 0), (5, 0.0, True, 0), (0, 0.0, False, 4),
    (0, 0.7, False, 7), (0, 0.0, True, 1)])
def test_attention_backend_matches_naive(block_size, heads, kv_heads, head_dim, num_decodes,
                                         num_prefills, window, softcap, sinks, chunk):
    rng = random.Random(block_size * 1000 + heads * 10 + num_decodes * 3 + num_prefills)
    decodes = [(1, rng.randint(1, 37)) for _ in range(num_decodes)]
    # prefill chunks: (query length, cached prefix), prefix not necessarily block-aligned
    prefills = [(rng.randint(1, 19), rng.choice([0, rng.randint(1, 23)]))
                for _ in range(num_prefills)]
    q_lens = [q for q, _ in decodes] + [q for q, _ in prefills]
    seq_lens = [s for _, s in decodes] + [q + p for q, p in prefills]
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 3
    pool = PagedPool(1, num_blocks, block_size, kv_heads, head_dim, seed=rng.randint(0, 99))
    for sid, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        pool.lens[sid] = seq_len - q_len
        pool.tables[sid] = [pool.free.pop() for _ in range(math.ceil(pool.lens[sid] / block_size))]
    _, ctx = pool.step(list(enumerate(q_lens)), num_decodes)
    t = sum(q_lens)
    q, k, v = (torch.randn(t + 2, h, head_dim) for h in (heads, kv_heads, kv_heads))
    ctx.slot_mapping = torch.cat([ctx.slot_mapping, torch.tensor([-1, -1])])   # padded rows
    backend, scale = TorchAttentionBackend(), head_dim ** -0.5
    cache = pool.kv_caches[0]
    before = cache.clone()
    backend.write_kv(cache, k, v, ctx.slot_mapping)
    slots = ctx.slot_mapping[:t]
    assert torch.equal(cache[slots // block_size, 0, slots % block_size], k[:t])
    assert torch.equal(cache[slots // block_size, 1, slots % block_size], v[:t])
    touched = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    touched[slots] = True
    untouched = (~touched).view(num_blocks, block_size)
    assert torch.equal(cache.transpose(1, 2)[untouched], before.transpose(1, 2)[untouched])

    sink = torch.randn(heads) * 2 if sinks else None       # gpt-oss's attention sinks
    out = backend.forward(q, cache, ctx, scale, window=window, softcap=softcap, sinks=sink,
                          chunk=chunk)
    tables = [pool.tables[sid] for sid in range(len(q_lens))]
    expected = naive_attention(q[:t], cache, tables, q_lens, seq_lens, scale, window, softcap,
                               sink, chunk)
    torch.testing.assert_close(out[:t], expected, atol=1e-5, rtol=1e-5)
    assert not out[t:].any()


@pytest.mark.slow
def test_default_gguf_matches_transformers(hf_default_model):
    files = resolve_model(str(default_model_path()))
    started = time.perf_counter()
    ours = load_model(read_model_config(files), files, torch.float32, "cpu")
    print(f"GGUF load: {time.perf_counter() - started:.2f} s")
    ref = hf_default_model
    prompt = [1, 504, 3575, 282, 4649, 314, 2114, 30, 378, 1789, 282]
    pool = pool_for(ours, num_blocks=16, block_size=4)
    tokens = {0: list(prompt)}
    logits = run_step(ours, pool, tokens, [(0, len(prompt))], num_decodes=0)[0]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    diff = (logits - expected).abs().max().item()
    print(f"GGUF prompt logits: max |diff| {diff:.2e}, max |logit| {expected.abs().max():.1f}")
    assert diff < 1e-3 * expected.abs().max().item()

    for _ in range(20):
        tokens[0].append(int(logits[-1].argmax()))
        logits = run_step(ours, pool, tokens, [(0, 1)], num_decodes=1)[0]
    with torch.no_grad():
        greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert tokens[0] == greedy[0].tolist()


@pytest.mark.parametrize("num_decodes", [1, 3])
def test_attention_backend_takes_strided_sdpa_outputs(monkeypatch, num_decodes):
    """CUDA's SDPA kernels return outputs that are not contiguous; the reference must cope."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)                       # [..., L, d] laid out as [..., d, L]
        return out.transpose(-1, -2).contiguous().transpose(-1, -2)

    block_size, heads, kv_heads, head_dim = 4, 4, 2, 8
    pool = PagedPool(1, 16, block_size, kv_heads, head_dim, seed=1)
    lens = [5 + 3 * i for i in range(num_decodes)]
    for sid, n in enumerate(lens):
        pool.lens[sid] = n - 1
        pool.tables[sid] = [pool.free.pop() for _ in range(math.ceil((n - 1) / block_size))]
    _, ctx = pool.step([(sid, 1) for sid in range(num_decodes)], num_decodes)
    q = torch.randn(num_decodes, heads, head_dim)
    k, v = (torch.randn(num_decodes, kv_heads, head_dim) for _ in range(2))
    backend, cache = TorchAttentionBackend(), pool.kv_caches[0]
    backend.write_kv(cache, k, v, ctx.slot_mapping)
    expected = backend.forward(q, cache, ctx, 0.3)
    monkeypatch.setattr(F, "scaled_dot_product_attention", strided_sdpa)
    torch.testing.assert_close(backend.forward(q, cache, ctx, 0.3), expected)
