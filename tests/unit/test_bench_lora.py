"""benchmarks/lora.py at a tiny size on the CPU: the adapters it writes pass the engine's
checks, and the three runs (base, 1 adapter, 8 adapters) produce every requested token."""
import pytest
from models_util import make_tiny_model

from benchmarks import lora as bench


@pytest.mark.slow
def test_runs_on_the_cpu(tmp_path):
    path = make_tiny_model("llama", tmp_path / "tiny", vocab_size=10240,
                           max_position_embeddings=256)
    result = bench.main(["--model", str(path), "--device", "cpu", "--num-requests", "8",
                         "--max-input", "24", "--max-output", "6", "--max-num-seqs", "8",
                         "--max-model-len", "128", "--rank", "4", "--adapters", "1,8"])
    want = result["base"]["output_tokens"]
    assert want > 0
    for n in (1, 8):
        r = result[f"adapters_{n}"]
        assert r["output_tokens"] == want and r["of_base"] > 0
