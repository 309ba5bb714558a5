"""The command line as a vLLM user types it: `serve MODEL`, vLLM's flag names and value forms,
refused flags of features not built, misspellings answered with the closest flag, help text on
every flag; and what the model flags resolve to (the local Hugging Face cache, generation
config defaults, chat templates). No model is loaded."""
import argparse
import json

import pytest
from models_util import make_tiny_model

from conveyor.cli import build_parser, http_config
from conveyor.cli_args import human_int, model_len
from conveyor.frontend.guard import Guard
from conveyor.frontend.tokenizer import read_chat_template
from conveyor.shared.config import EngineConfig
from conveyor.shared.generation_config import default_sampling
from conveyor.shared.model_files import ModelNotFound, resolve_model


def parse(*argv):
    return build_parser().parse_args(list(argv))


def refusal(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_serve_takes_the_model_as_its_first_argument(capsys):
    assert parse("serve", "Qwen/Qwen3-0.6B").model == "Qwen/Qwen3-0.6B"
    assert parse("serve", "--model", "m.gguf").model == "m.gguf"
    assert parse("serve", "m.gguf", "--model", "m.gguf").model == "m.gguf"
    assert parse("serve").model is None                      # the default model
    assert "given twice" in refusal(capsys, "serve", "a", "--model", "b")


def test_vllm_flag_names_and_value_forms():
    args = parse("serve", "m", "-tp", "2", "--dtype", "half", "--max-model-len", "4k",
                 "--served-model-name", "a", "b", "--served-model-name", "c",
                 "--disable-log-requests", "--uvicorn-log-level", "info",
                 "--max-num-batched-tokens", "8K", "--kv-cache-memory-bytes", "1G",
                 "--generation-config", "vllm", "--revision", "v2", "-pp", "3", "-dp", "2",
                 "--distributed-executor-backend", "mp", "--hf-overrides",
                 '{"rope_scaling": {"factor": 2.0}}', "--ssl-keyfile", "k.pem",
                 "--ssl-certfile", "c.pem", "--allowed-origins", "https://a.example")
    assert (args.tensor_parallel_size, args.max_model_len, args.served_model_name) == (
        2, 4000, ["a", "b", "c"])
    assert (args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (8192, 1 << 30)
    assert (args.data_parallel_size, args.dp_routing_policy) == (2, "prefix_affinity")
    assert args.distributed_executor_backend == "mp"
    assert parse("serve", "--distributed-executor-backend", "ray").distributed_executor_backend \
        == "ray"
    assert args.pipeline_parallel_size == 3
    from conveyor.cli import engine_kwargs
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (config.dtype, config.generation_config, config.revision) == ("float16", "vllm", "v2")
    assert config.hf_overrides == {"rope_scaling": {"factor": 2.0}}
    http = http_config(args)
    assert http.served_model_names == ("a", "b", "c") and http.uvicorn_log_level == "info"
    assert (http.scheme, http.ssl_keyfile, http.allowed_origins) == (
        "https", "k.pem", ("https://a.example",))
    for text, tokens in (("32K", 32768), ("1m", 10 ** 6), ("1M", 1 << 20), ("-1", None),
                         ("auto", None), ("4096", 4096), ("1.5k", 1500)):
        assert model_len(text) == tokens, text
    assert parse("generate", "hi", "--max-model-len", "-1").max_model_len is None
    for dtype, name in (("float", "float32"), ("half", "float16"), ("bfloat16", "bfloat16")):
        assert EngineConfig(dtype=dtype).dtype == name
    assert EngineConfig(max_model_len=-1).max_model_len is None
    with pytest.raises(argparse.ArgumentTypeError):
        human_int("4.5")
    with pytest.raises(argparse.ArgumentTypeError):
        human_int("lots")


def test_an_unknown_executor_backend_is_refused(capsys):
    line = refusal(capsys, "serve", "--distributed-executor-backend", "torchrun")
    assert "invalid choice: 'torchrun'" in line, line


def test_a_misspelt_flag_gets_the_closest_one(capsys):
    assert "did you mean --max-model-len?" in refusal(capsys, "serve", "--max-modle-len", "4k")
    assert "did you mean --tensor-parallel-size?" in refusal(
        capsys, "serve", "--tensor-paralel-size=2")
    assert "did you mean --temperature?" in refusal(capsys, "generate", "hi", "--temprature",
                                                    "0")
    assert "conveyor serve --help" in refusal(capsys, "serve", "--zzz")


def test_trust_remote_code_is_accepted_and_says_what_it_does(capsys):
    assert parse("serve", "--trust-remote-code").trust_remote_code
    assert "runs no code from model repositories" in capsys.readouterr().err


def test_every_flag_has_help_and_serve_groups_them():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
    titles = {g.title for g in sub.choices["serve"]._action_groups}
    assert {"server", "model", "KV cache", "scheduler", "parallel", "quantization"} <= titles
    help_text = sub.choices["serve"].format_help()
    assert "-tp" in help_text and "--max-model-len N" in help_text


def test_metrics_answer_without_the_key_unless_guarded():
    def status(guard, path):
        refusal = guard._check({"headers": []}, path)
        return None if refusal is None else refusal[0]

    open_ = Guard(None, ("k",))
    assert [status(open_, p) for p in ("/metrics", "/health", "/ping", "/version")] == [None] * 4
    assert [status(open_, p) for p in ("/v1/models", "/tokenize", "/admin")] == [401] * 3
    assert status(Guard(None, ("k",), metrics_need_api_key=True), "/metrics") == 401


def _hub_cache(root, repo: str, commit: str, ref: str | None = "main"):
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    make_tiny_model("llama", snapshot, weights=False)
    if ref is not None:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot


def test_a_hub_id_is_found_in_the_local_cache(tmp_path, monkeypatch):
    home = tmp_path / "hf-home"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    main = _hub_cache(home / "hub", "org/tiny", "a" * 40)
    other = _hub_cache(home / "hub", "org/tiny", "b" * 40, ref="v2")
    assert resolve_model("org/tiny").path == main and not resolve_model("org/tiny").is_gguf
    assert resolve_model("org/tiny", "v2").path == other          # a tag or branch
    assert resolve_model("org/tiny", "bbbbbbb").path == other     # a commit (prefix)
    hub = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))                  # looked in first
    assert resolve_model("org/tiny").path == main                 # still found in HF_HOME
    first = _hub_cache(hub, "org/tiny", "c" * 40)
    assert resolve_model("org/tiny").path == first
    with pytest.raises(ModelNotFound) as e:
        resolve_model("org/absent")
    message = str(e.value)
    assert str(hub) in message and str(home / "hub") in message
    assert "does not download" in message and "huggingface-cli download org/absent" in message
    with pytest.raises(ModelNotFound, match="revision 'v9'"):
        resolve_model("org/tiny", "v9")
    with pytest.raises(ModelNotFound, match="no model at"):
        resolve_model(str(tmp_path / "nope"))


def test_generation_config_gives_default_sampling(tmp_path):
    model = make_tiny_model("llama", tmp_path / "m", weights=False)
    files = resolve_model(str(model))
    assert default_sampling(files, "auto") == {}                  # no file: no defaults
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64,
         "do_sample": True, "bos_token_id": 1}))
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert default_sampling(files, "auto") == want
    assert default_sampling(files, "vllm") == {}
    assert default_sampling(files, str(model)) == want           # a folder
    with pytest.raises(ValueError, match="generation_config"):
        default_sampling(files, str(tmp_path / "nowhere"))


def test_chat_template_from_a_file_or_inline(tmp_path):
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert read_chat_template(inline) == inline
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    assert read_chat_template(str(path)) == inline
    with pytest.raises(ValueError, match="neither a file nor"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        read_chat_template("{% for m in messages %}")
