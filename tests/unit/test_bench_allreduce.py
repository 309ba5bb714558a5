"""benchmarks/allreduce.py on CPU (gloo, 4 processes): every rank's sum is checked before it
is timed, and the report's per-step figure is 2 x layers all-reduces."""
import json

from benchmarks.allreduce import main


def test_gloo_four_ranks(tmp_path):
    out = tmp_path / "allreduce.jsonl"
    results = main(["--backend", "gloo", "--world-size", "4", "--hidden", "64", "--layers", "3",
                    "--vocab", "1000", "--batch", "1,8", "--iters", "5", "--dtype", "float32",
                    "--json", str(out)])
    assert [r["batch"] for r in results] == [1, 8]
    for r in results:
        assert r["world_size"] == 4 and r["allreduce_graph_us"] is None
        assert r["allreduce_us"] > 0 and r["allgather_logits_us"] > 0
        assert abs(r["allreduce_per_step_ms"] - 6 * r["allreduce_us"] / 1e3) < 1e-2
    assert [json.loads(line) for line in out.read_text().splitlines()] == results
