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
