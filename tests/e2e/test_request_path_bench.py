"""scripts/bench_request_path.py end to end on CPU with the default model, shrunk to 6 short
requests and no Poisson rates: the offline, ZMQ and HTTP passes each report a throughput, the
JSON document holds them with their ratios to offline, and every HTTP request succeeded."""
import json

import pytest

from benchmarks import request_path
from conveyor.shared.model_files import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not default_model_path().is_file(),
                                                   reason="default model not fetched")]


def test_three_paths_on_the_default_model(tmp_path, capsys):
    out = tmp_path / "run.json"
    request_path.main(["--num-requests", "6", "--input-len", "8:32", "--output-len", "4:8",
                       "--rates", "", "--client-procs", "2", "--output", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["device"] == "cpu" and doc["model"] == "default"
    assert doc["workload"]["num_requests"] == 6 and not doc["workload"]["reference"]
    paths = doc["paths"]
    assert set(paths) == {"offline", "zmq", "http"}
    for p in paths.values():
        assert p["tok_per_s"] > 0 and p["vs_offline"] > 0
    assert paths["offline"]["vs_offline"] == 1.0
    assert paths["zmq"]["vs_offline"] == pytest.approx(
        paths["zmq"]["tok_per_s"] / paths["offline"]["tok_per_s"])
    # every request ran to its max_tokens (ignore_eos) on each path
    assert paths["offline"]["output_tokens"] == paths["zmq"]["output_tokens"] == \
        paths["http"]["total_output_tokens"] == doc["workload"]["max_tokens"]
    http = paths["http"]
    assert http["failed"] == 0 and len(http["requests"]) == 6
    assert all(r["ttft"] > 0 and r["e2e"] >= r["ttft"] for r in http["requests"])
    assert doc["rates"] == [] and (tmp_path / "run.server.log").is_file()
    printed = capsys.readouterr().out
    assert "vs offline" in printed and f"results: {out}" in printed
