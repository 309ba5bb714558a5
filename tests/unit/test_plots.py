"""benchmarks/plots.py draws both figures from small synthetic request-path documents."""
import json

import pytest

from benchmarks import plots


def request(ttft, gaps, error=None) -> dict:
    return {"start": 0.0, "ttft": ttft, "e2e": (ttft or 0) + sum(gaps), "tpot": None, "itl": gaps,
            "output_tokens": len(gaps) + 1, "prompt_tokens": 100, "error": error}


def document(device: str, scale: float) -> dict:
    rates = []
    for k, rate in enumerate(["4", "16", "inf"]):
        ttfts = [scale * (0.05 + 0.02 * i + 0.1 * k) for i in range(6)]
        reqs = [request(t, [0.01 * (1 + i % 3)] * 5) for i, t in enumerate(ttfts)]
        reqs.append(request(None, [], error="HTTP 500: boom"))
        rates.append({"rate": rate, "tok_per_s": 100.0 * (k + 1) / scale, "requests": reqs,
                      "ttft_ms": {"p50": 1000 * ttfts[3], "p99": 1000 * ttfts[-1]}})
    return {"benchmark": "request_path", "device": device, "model": "/m/qwen3-0.6b",
            "git_revision": "abc1234", "paths": {"offline": {"tok_per_s": 500.0 / scale}},
            "rates": rates}


def test_both_figures_from_one_and_from_two_runs(tmp_path):
    files = []
    for name, scale in (("a", 1.0), ("b", 2.0)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(document(f"dev-{name}", scale)))
    one = plots.main([str(files[0]), "--out-dir", str(tmp_path / "one")])
    two = plots.main([*map(str, files), "--out-dir", str(tmp_path / "two"), "--prefix", "x"])
    assert [p.name for p in one] == ["request_path_rates.png", "request_path_cdf.png"]
    assert [p.name for p in two] == ["x_rates.png", "x_cdf.png"]
    assert all(p.stat().st_size > 10_000 for p in one + two)
    assert plots.label(document("H200", 1.0), "f.json") == "H200, qwen3-0.6b, abc1234"


def test_rate_positions_and_ecdf():
    assert plots.rate_positions([document("d", 1.0)]) == {"4": 4.0, "16": 16.0, "inf": 32.0}
    assert plots.ecdf([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])
    with pytest.raises(SystemExit):
        plots.main(["--label", "only-one"])
