"""Rotary tables against transformers': Phi-3's LongRoPE (short factors before
original_max_position_embeddings, long ones from there, times the attention factor) over part of
each head, and the partial rotation itself."""
import pytest
import torch

from conveyor.shared.model_config import ModelConfig
from conveyor.worker.layers.rotary import apply_rotary
from conveyor.worker.models.phi3 import Phi3ForCausalLM


@pytest.mark.parametrize("attention_factor", [None, 1.3])
def test_longrope_matches_transformers(attention_factor):
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    scaling = {"type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.5],
               "long_factor": [2.0, 3.1, 4.7, 9.0]}
    if attention_factor:
        scaling["attention_factor"] = attention_factor
    hf = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256, original_max_position_embeddings=64,
                                 partial_rotary_factor=0.5, rope_scaling=scaling, pad_token_id=0)
    ours = Phi3ForCausalLM.rotary_embedding(ModelConfig.from_hf(
        {**hf.to_dict(), "architectures": ["Phi3ForCausalLM"]}))
    ref = Phi3RotaryEmbedding(hf)
    x = torch.zeros(1, 1, 8)
    for positions in (torch.arange(64), torch.arange(64, 256)):   # short, then long factors
        cos, sin = ref(x, positions[None])
        want_cos, want_sin = cos[0, :, :4], sin[0, :, :4]      # HF repeats the halves
        got_cos, got_sin = ours(positions)
        torch.testing.assert_close(got_cos, want_cos)
        torch.testing.assert_close(got_sin, want_sin)


def test_partial_rotary_turns_only_the_first_features():
    x = torch.randn(5, 3, 16)
    angles = torch.randn(5, 4)
    out = apply_rotary(x, angles.cos(), angles.sin())
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], apply_rotary(x[..., :8], angles.cos(), angles.sin()))
    assert not torch.allclose(out[..., :8], x[..., :8])


YARN = [
    # gpt-oss's own (head_dim 64, 4k original context stretched 32 times, no truncation)
    dict(head_dim=64, theta=150000.0, max_pos=131072,
         rope={"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
               "original_max_position_embeddings": 4096}),
    # the correction range truncated (the default), beta_* defaulted
    dict(head_dim=16, theta=10000.0, max_pos=128,
         rope={"factor": 4.0, "original_max_position_embeddings": 32}),
    # a given attention factor; then DeepSeek's mscale / mscale_all_dim ratio
    dict(head_dim=32, theta=1e6, max_pos=512,
         rope={"factor": 8.0, "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0,
               "original_max_position_embeddings": 64}),
    dict(head_dim=32, theta=1e4, max_pos=256,
         rope={"factor": 2.5, "mscale": 1.0, "mscale_all_dim": 0.7,
               "original_max_position_embeddings": 100}),
]


@pytest.mark.parametrize("case", range(len(YARN)))
def test_yarn_matches_transformers(case):
    """YaRN's frequencies and cos/sin scaling against transformers' rope init and gpt-oss's
    rotary embedding, from both forms of config.json (transformers 5's rope_parameters, and
    the hub's rope_scaling beside rope_theta)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from conveyor.worker.models.llama import LlamaForCausalLM

    c = YARN[case]
    d = c["head_dim"]
    hf = transformers.GptOssConfig(
        hidden_size=4 * d, head_dim=d, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, max_position_embeddings=c["max_pos"],
        rope_parameters={"rope_type": "yarn", "rope_theta": c["theta"], **c["rope"]})
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf)
    positions = torch.cat([torch.arange(40), torch.randint(40, c["max_pos"], (60,))])
    want_cos, want_sin = (t[0] for t in GptOssRotaryEmbedding(hf)(torch.zeros(1),
                                                                  positions[None]))
    hub = {**hf.to_dict(), "architectures": ["GptOssForCausalLM"], "rope_theta": c["theta"],
           "rope_scaling": {"rope_type": "yarn", **c["rope"]}}
    del hub["rope_parameters"]
    for cfg in ({**hf.to_dict(), "architectures": ["GptOssForCausalLM"]}, hub):
        ours = LlamaForCausalLM.rotary_embedding(ModelConfig.from_hf(cfg))
        got_cos, got_sin = ours(positions)
        angles = torch.outer(positions.float(), inv_freq)
        torch.testing.assert_close(got_cos, angles.cos() * attention)
        torch.testing.assert_close(got_cos, want_cos)
        torch.testing.assert_close(got_sin, want_sin)
    assert attention != 1.0
