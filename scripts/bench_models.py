"""Random-weight models of published shapes (../shared GPU.md), saved as Hugging Face folders so
the engine loads them like any checkpoint. Used by the GPU benchmarks and tests.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6)),
    "llama3.1-8b": ("LlamaConfig", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})),
}


def build_random_model(shape: str, folder: str | Path | None = None, seed: int = 0,
                       **overrides) -> Path:
    """Save a random bfloat16 model of `shape` (see SHAPES) into `folder` (a temp dir if None);
    `overrides` change config fields, e.g. num_hidden_layers=4."""
    import transformers

    config_class, args = SHAPES[shape]
    config = getattr(transformers, config_class)(**{**args, "bos_token_id": 1,
                                                    "eos_token_id": 2, **overrides})
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):   # random init on the GPU: seconds, not minutes, for 8B
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder = Path(folder or tempfile.mkdtemp(prefix=f"conveyor-{shape}-"))
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def add_model_args(ap) -> None:
    """--model, or --shape with --random-weights; plus --num-layers to shorten a shape, and
    --quantization / --keep-precision for the engine (see quant_args)."""
    ap.add_argument("--model", help="a Hugging Face folder")
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--random-weights", action="store_true",
                    help="build --shape with random weights (nothing downloaded)")
    ap.add_argument("--num-layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--quantization", choices=["int8", "fp8"], default=None,
                    help="quantize the weights at load (docs/QUANTIZATION.md)")
    ap.add_argument("--keep-precision", default="lm_head,embed_tokens", metavar="PATTERNS",
                    help="layers left unquantized (comma-separated regexes)")


def quant_args(args) -> dict:
    """The engine arguments of --quantization and --keep-precision."""
    return {"quantization": args.quantization, "keep_precision": args.keep_precision}


def model_path(args, ap) -> str:
    if args.model is not None:
        return args.model
    if not (args.shape and args.random_weights):
        ap.error("give --model, or --shape with --random-weights")
    extra = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
    return str(build_random_model(args.shape, **extra))


def append_json(path: str | None, result: dict) -> None:
    """Append one result as a JSON line (for collecting runs), if a path was given."""
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")


@contextlib.contextmanager
def serve_process(*args: str, timeout: float = 900):
    """`conveyor serve ARGS` in its own process group; yields its "serving on" line, then
    SIGTERMs it (the launcher drains, then stops its children), killing the group if it hangs."""
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", *args],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, line = time.monotonic() + timeout, ""
        while "serving on" not in line:
            line = proc.stdout.readline()
            if (not line and proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"conveyor serve {' '.join(args)} did not start")
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
