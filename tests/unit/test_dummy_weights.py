"""load_format="dummy": the tensors it draws are those of a Hugging Face checkpoint (names and
shapes, against transformers), the draw depends on the seed and nothing else, and the loaded
model holds them (fused q/k/v and gate/up included)."""
import pytest
import torch
from models_util import PRESETS, make_tiny_model

from conveyor.shared.config import EngineConfig
from conveyor.shared.model_files import read_model_config, resolve_model
from conveyor.worker.dummy_weights import checkpoint_shapes, dummy_weights
from conveyor.worker.loader import load_model


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_checkpoint_shapes_are_transformers_own(arch, tmp_path):
    """The names and shapes transformers saves (as the model's convert_weights reads them:
    Phi-3's fused qkv split, Mixtral's expert names mapped)."""
    from conveyor.worker.checkpoint_files import Checkpoint
    from conveyor.worker.models import get_model_class

    path = make_tiny_model(arch, tmp_path, num_hidden_layers=3)
    config = read_model_config(resolve_model(str(path)))
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    saved = Checkpoint(path).weights()
    if hasattr(model, "convert_weights"):
        saved = model.convert_weights(saved)
    expected = {name: tuple(t.shape) for name, t in saved}
    assert checkpoint_shapes(config) == expected


def test_dummy_model_holds_the_drawn_tensors(tmp_path):
    path = make_tiny_model("qwen2", tmp_path, weights=False, initializer_range=0.05)
    files = resolve_model(str(path))
    config = read_model_config(files)
    assert config.initializer_range == 0.05
    model = load_model(config, files, torch.float32, "cpu", load_format="dummy", seed=7)
    drawn = dict(dummy_weights(config, torch.float32, "cpu", seed=7))
    params = dict(model.named_parameters())
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert torch.equal(params[attn + "qkv_proj.weight"], torch.cat(
        [drawn[attn + f"{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(params[attn + "qkv_proj.bias"], torch.cat(
        [drawn[attn + f"{p}_proj.bias"] for p in "qkv"]))
    assert torch.equal(params[mlp + "gate_up_proj.weight"], torch.cat(
        [drawn[mlp + "gate_proj.weight"], drawn[mlp + "up_proj.weight"]]))
    assert torch.equal(params["lm_head.weight"], drawn["lm_head.weight"])
    embed = params["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.05) < 0.005 and abs(embed.mean().item()) < 0.005
    norm = params["model.norm.weight"]
    assert abs(norm.mean().item() - 1) < 0.03 and 0 < norm.std().item() < 0.1


def test_dummy_gpt_oss_holds_its_sinks_and_expert_biases(tmp_path):
    """gpt-oss's tensors beyond Llama's: attention sinks, the router's bias, each expert's
    biases (gate and up into w13_bias, down into w2_bias)."""
    path = make_tiny_model("gpt-oss", tmp_path, weights=False)
    files = resolve_model(str(path))
    config = read_model_config(files)
    model = load_model(config, files, torch.float32, "cpu", load_format="dummy", seed=2)
    drawn = dict(dummy_weights(config, torch.float32, "cpu", seed=2))
    layer, p = model.model.layers[3], "model.layers.3."
    assert torch.equal(layer.self_attn.sinks, drawn[p + "self_attn.sinks"])
    assert torch.equal(layer.mlp.gate.bias, drawn[p + "mlp.gate.bias"])
    e = p + "mlp.experts.1."
    assert torch.equal(layer.mlp.experts.w13_bias[1], torch.cat(
        [drawn[e + "gate_proj.bias"], drawn[e + "up_proj.bias"]]))
    assert torch.equal(layer.mlp.experts.w2_bias[1], drawn[e + "down_proj.bias"])


def test_dummy_weights_depend_on_the_seed_only(tmp_path):
    config = read_model_config(resolve_model(str(make_tiny_model("llama", tmp_path,
                                                                  weights=False))))
    a = dict(dummy_weights(config, torch.float32, "cpu", seed=0))
    b = dict(dummy_weights(config, torch.float32, "cpu", seed=0))
    c = dict(dummy_weights(config, torch.float32, "cpu", seed=1))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(torch.equal(a[n], c[n]) for n in a)
    # tensors of one shape are not copies of each other
    assert not torch.equal(a["model.layers.0.mlp.gate_proj.weight"],
                           a["model.layers.0.mlp.up_proj.weight"])


def test_load_format_is_checked():
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="safetensors")
