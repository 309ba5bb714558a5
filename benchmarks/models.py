"""Random-weight models of published shapes (../shared GPU.md), saved as Hugging Face folders so
the engine loads them like any checkpoint, with a synthetic tokenizer of the shape's vocabulary
size (so `conveyor serve --model FOLDER` detokenizes). Used by the GPU benchmarks and tests.

A shape whose bf16 checkpoint does not fit the free disk (llama3.1-70b: 141 GB) is written as
config.json alone and loaded with load_format="dummy": the engine draws the weights itself.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.synthetic_tokenizer import BOS_ID, EOS_ID, save_tokenizer

# what Llama 3.1 8B and 70B share
_LLAMA31 = dict(num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6)),
    "llama3.1-8b": ("LlamaConfig", dict(_LLAMA31, num_hidden_layers=32, hidden_size=4096,
                                        num_attention_heads=32, intermediate_size=14336)),
    "llama3.1-70b": ("LlamaConfig", dict(_LLAMA31, num_hidden_layers=80, hidden_size=8192,
                                         num_attention_heads=64, intermediate_size=28672)),
    # 128 experts of width 768, 8 a token: 3.3 B of its 30.5 B parameters active a token
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6,
        max_position_embeddings=40960, rms_norm_eps=1e-6)),
    # transformers' defaults are gpt-oss-120b's: 36 layers of 128 experts, 4 a token, H = I =
    # 2880; --int4 mxfp4 writes its experts as published
    "gpt-oss-20b": ("GptOssConfig", dict(num_hidden_layers=24, num_local_experts=32)),
    "gpt-oss-120b": ("GptOssConfig", dict()),
}


def hf_config(shape: str, **overrides):
    """The transformers config of `shape` (see SHAPES), with `overrides` applied."""
    import transformers

    config_class, args = SHAPES[shape]
    config = getattr(transformers, config_class)(**{**args, "bos_token_id": 1,
                                                    "eos_token_id": 2, **overrides})
    config.architectures = [config_class.replace("Config", "ForCausalLM")]
    return config


def checkpoint_bytes(shape: str, **overrides) -> int:
    """Size of the bf16 checkpoint of `shape` (from conveyor's list of its tensors)."""
    from conveyor.shared.model_config import ModelConfig
    from conveyor.worker.dummy_weights import checkpoint_shapes

    config = ModelConfig.from_hf(hf_config(shape, **overrides).to_dict())
    return 2 * sum(torch.Size(s).numel() for s in checkpoint_shapes(config).values())


def build_random_model(shape: str, folder: str | Path | None = None, seed: int = 0,
                       weights: bool = True, **overrides) -> Path:
    """Save a random bfloat16 model of `shape` (see SHAPES) into `folder` (a temp dir if None),
    with a synthetic tokenizer of the shape's vocabulary size (benchmarks/synthetic_tokenizer.py);
    `overrides` change config fields, e.g. num_hidden_layers=4. weights=False writes config.json
    and the tokenizer only, for load_format="dummy" (the engine draws normal(0,
    initializer_range) weights)."""
    import transformers

    config = hf_config(shape, **overrides)
    folder = Path(folder or tempfile.mkdtemp(prefix=f"conveyor-{shape}-"))
    if (config.bos_token_id, config.eos_token_id) != (BOS_ID, EOS_ID):
        raise ValueError(f"the synthetic tokenizer has bos {BOS_ID} and eos {EOS_ID}, not "
                         f"{config.bos_token_id} and {config.eos_token_id}")
    save_tokenizer(folder, config.vocab_size, config.max_position_embeddings)
    if not weights:
        config.save_pretrained(folder)
        return folder
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):   # random init on the GPU: seconds, not minutes, for 8B
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def build_random_quantized(shape: str, fmt: str, folder: str | Path | None = None,
                           group: int = 128, seed: int = 0, **overrides) -> Path:
    """Save a random quantized checkpoint of `shape` in the published layout of `fmt`, with a
    synthetic tokenizer: "awq" or "gptq" (4-bit, group size `group`; docs/QUANTIZATION.md:
    random 4-bit values, zero points 8, scales about initializer_range / 4), "fp8" (e4m3
    weights with `group` x `group` block scales, DeepSeek's and Qwen's FP8 layout, MoE experts
    included: random e4m3 values of about one, scales initializer_range), or "mxfp4" (gpt-oss
    shapes: the experts as gpt-oss publishes them, `_mxfp4_experts`; the rest in bf16). The
    router, embedding, LM head and norms are drawn in bf16. Only the bytes and shapes matter
    (for timing): written tensor by tensor, without building the model."""
    import json

    from safetensors.torch import save_file

    from conveyor.shared.model_config import ModelConfig
    from conveyor.worker.dummy_weights import checkpoint_shapes

    config = hf_config(shape, **overrides)
    folder = Path(folder or tempfile.mkdtemp(prefix=f"conveyor-{shape}-{fmt}-"))
    save_tokenizer(folder, config.vocab_size, config.max_position_embeddings)
    config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if fmt == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [group, group]}
    elif fmt == "mxfp4":
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
    else:
        cfg["quantization_config"] = {"quant_method": fmt, "bits": 4, "group_size": group,
                                      **({"version": "gemm", "zero_point": True} if fmt == "awq"
                                         else {"desc_act": False, "sym": True})}
    (folder / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    eights = torch.tensor(0x88888888 - 2 ** 32, dtype=torch.int32)   # zero point 8, 8 nibbles
    tensors, part, drawn = {}, 0, {}

    def flush():
        nonlocal tensors, part
        if tensors:
            save_file(tensors, folder / f"model-{part:05d}.safetensors", metadata={"format": "pt"})
            tensors, part = {}, part + 1

    for name, shp in checkpoint_shapes(ModelConfig.from_hf(cfg)).items():
        if fmt == "mxfp4" and ".mlp.experts." in name:
            continue                                # written stacked, with the layer's router
        if fmt == "mxfp4" and name.endswith(".mlp.gate.weight"):
            tensors.update(_mxfp4_experts(name.removesuffix("gate.weight") + "experts.", config,
                                          gen, drawn))
        if (len(shp) == 2 and name.startswith("model.layers.") and fmt != "mxfp4"
                and ".mlp.gate.weight" not in name):
            n, k = shp
            stem = name.removesuffix(".weight")
            # one random tensor a shape, copied: drawing an MoE's 30B values one expert at a
            # time takes minutes
            if shp not in drawn:
                drawn[shp] = (torch.randn(shp, generator=gen).to(torch.float8_e4m3fn)
                              if fmt == "fp8" else
                              torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8) if fmt == "awq"
                                            else (k // 8, n), generator=gen, dtype=torch.int32))
            if fmt == "fp8":
                tensors[name] = drawn[shp].clone()
                tensors[stem + ".weight_scale_inv"] = torch.full((-(-n // group), k // group),
                                                                 std)
                continue
            tensors[stem + ".qweight"] = drawn[shp].clone()
            tensors[stem + ".qzeros"] = eights.expand(k // group, n // 8).clone()
            tensors[stem + ".scales"] = torch.full((k // group, n), std / 4, dtype=torch.float16)
            if fmt == "gptq":
                tensors[stem + ".g_idx"] = (torch.arange(k) // group).int()
        else:
            t = torch.randn(shp, generator=gen) * std
            tensors[name] = (t + 1 if name.endswith("norm.weight") else t).bfloat16()
        if sum(t.numel() * t.element_size() for t in tensors.values()) > 2 << 30:
            flush()
    flush()
    return folder


def _mxfp4_experts(prefix: str, config, gen: torch.Generator, drawn: dict) -> dict:
    """One layer's experts as gpt-oss publishes them (worker/mxfp4_checkpoint.py): gate/up and
    down stacked, in MXFP4 blocks of random bytes with scales 2^round(log2(initializer_range /
    3)) (random e2m1 codes have an RMS of about 3), and bf16 biases; the bytes drawn once a
    shape and copied."""
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    exponent = 127 + round(math.log2(config.initializer_range / 3))
    out = {}
    for proj, rows, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        shape = (e, rows, k // 32, 16)
        if shape not in drawn:
            drawn[shape] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        out[prefix + proj + "_blocks"] = drawn[shape].clone()
        out[prefix + proj + "_scales"] = torch.full(shape[:3], exponent, dtype=torch.uint8)
        out[prefix + proj + "_bias"] = (torch.randn(e, rows, generator=gen)
                                        * config.initializer_range).bfloat16()
    return out


def add_model_args(ap) -> None:
    """--model, or --shape with --random-weights (--int4 for a random AWQ, GPTQ or MXFP4
    checkpoint, --fp8-blocks for a block-scaled fp8 one);
    plus --num-layers to shorten a shape, and --load-format, and --quantization /
    --keep-precision / --kv-cache-dtype for the engine (see quant_args)."""
    ap.add_argument("--model", help="a Hugging Face folder")
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--random-weights", action="store_true",
                    help="build --shape with random weights (nothing downloaded)")
    ap.add_argument("--num-layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                    help="dummy: random weights drawn by the engine from config.json alone "
                         "(default for --random-weights: dummy if the bf16 checkpoint would not "
                         "fit the free disk, else a saved checkpoint)")
    ap.add_argument("--quantization", choices=["int8", "fp8"], default=None,
                    help="quantize the weights at load (docs/QUANTIZATION.md)")
    ap.add_argument("--int4", choices=["awq", "gptq", "mxfp4"], default=None,
                    help="with --shape --random-weights: a random 4-bit checkpoint in this "
                         "format (group 128; mxfp4: a gpt-oss shape's experts), loaded as "
                         "published")
    ap.add_argument("--fp8-blocks", action="store_true",
                    help="with --shape --random-weights: a random fp8 checkpoint with 128 x 128 "
                         "block scales (the layout of Qwen's and DeepSeek's FP8 releases), "
                         "loaded as published")
    ap.add_argument("--keep-precision", default="lm_head,embed_tokens", metavar="PATTERNS",
                    help="layers left unquantized (comma-separated regexes)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                    help="fp8: a float8 e4m3 KV pool (docs/ARCHITECTURE.md)")


def quant_args(args) -> dict:
    """The engine arguments of --quantization, --keep-precision and --kv-cache-dtype."""
    return {"quantization": args.quantization, "keep_precision": args.keep_precision,
            "kv_cache_dtype": args.kv_cache_dtype}


def model_path(args, ap) -> str:
    """The model folder to run; sets args.load_format where it was left to choose."""
    if args.model is not None:
        args.load_format = args.load_format or "auto"
        return args.model
    if not (args.shape and args.random_weights):
        ap.error("give --model, or --shape with --random-weights")
    fmt = getattr(args, "int4", None) or ("fp8" if getattr(args, "fp8_blocks", False) else None)
    if fmt:
        extra = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
        args.load_format = "auto"
        return str(build_random_quantized(args.shape, fmt, **extra))
    path, args.load_format = random_model(args.shape, args.num_layers, args.load_format)
    return path


def random_model(shape: str, num_layers: int | None = None,
                 load_format: str | None = None) -> tuple[str, str]:
    """(folder, load format) of a new random model of `shape`; load_format None chooses dummy
    (config.json and tokenizer only) if the bf16 checkpoint would not fit the free disk."""
    extra = {"num_hidden_layers": num_layers} if num_layers else {}
    if load_format is None:
        size = checkpoint_bytes(shape, **extra)
        free = shutil.disk_usage(tempfile.gettempdir()).free
        load_format = "dummy" if size > 0.8 * free else "auto"
        if load_format == "dummy":
            print(f"{shape}: the bf16 checkpoint ({size / 1e9:.0f} GB) does not fit the "
                  f"free disk ({free / 1e9:.0f} GB): load_format=dummy", file=sys.stderr)
    return str(build_random_model(shape, weights=load_format != "dummy", **extra)), load_format


def engine_flags(engine: dict) -> list[str]:
    """EngineConfig keyword arguments as `conveyor serve` flags (--x, --no-x for booleans); an
    argument left at None is left off, so serve takes its own default."""
    def flag(k, v):
        name = k.replace("_", "-")
        return f"--{name}" if v is True else f"--no-{name}" if v is False else f"--{name}={v}"
    return [flag(k, v) for k, v in engine.items() if v is not None]


def append_json(path: str | None, result: dict) -> None:
    """Append one result as a JSON line (for collecting runs), if a path was given."""
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")


def conveyor_env() -> dict[str, str]:
    """Our environment with the folder of the conveyor this process imports first on PYTHONPATH,
    so that a `python -m conveyor.cli` child runs the same code whatever its cwd."""
    root = str(Path(importlib.util.find_spec("conveyor").origin).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH")]))}


@contextlib.contextmanager
def serve_process(*args: str, timeout: float = 900, stderr=None):
    """`conveyor serve ARGS` (the conveyor this process imports) in its own process group;
    yields its "serving on" line, then SIGTERMs it (the launcher drains, then stops its
    children), killing the group if it hangs. stderr: a file for the server's log, its output
    included (the start-up summary, the stats lines); default: ours."""
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True, env=conveyor_env())
    log = stderr or sys.stdout
    try:
        deadline, line = time.monotonic() + timeout, ""
        while "serving on" not in line:
            line = proc.stdout.readline()
            log.write(line)
            if (not line and proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"conveyor serve {' '.join(args)} did not start")
        # the rest of its output goes to the log as it comes, so the pipe never fills
        threading.Thread(target=lambda: log.writelines(proc.stdout), daemon=True).start()
        yield line
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def served(path: str, tp: int, *args: str, timeout: float = 900):
    """`conveyor serve` of a token-only model on the GPU(s) (ZMQ only); yields a Client."""
    from conveyor.client import Client

    with serve_process("--model", path, "--device", "cuda", "--tp", str(tp), "--port", "-1",
                       "--zmq-port", "0", "--skip-tokenizer-init", *args,
                       timeout=timeout) as line:
        with Client(re.search(r"tcp://[\d.]+:\d+", line).group(0), timeout=timeout) as client:
            yield client
