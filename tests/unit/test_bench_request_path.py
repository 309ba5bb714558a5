"""benchmarks/request_path.py's pure parts (per-pass prompts, reports, the tables, the JSON
document, argument checks) and its HTTP client processes against a fake OpenAI server."""
import json
import math

import pytest
from fake_openai import fake_openai_server

from benchmarks import request_path as rp
from benchmarks.client_pool import ClientPool
from benchmarks.reference_workload import workload
from benchmarks.serving import Result


def test_each_pass_keeps_the_lengths_and_draws_its_own_contents():
    prompts, _ = workload(32)
    offline = rp.pass_prompts(prompts, None)
    assert offline is prompts                                   # the seed-0 prompts exactly
    passes = [rp.pass_prompts(prompts, s) for s in ("zmq", "http", "rate 4", "rate 16")]
    firsts = [{tuple(p[:16]) for p in ps} for ps in [offline, *passes]]
    for ps in passes:
        assert [len(p) for p in ps] == [len(p) for p in prompts]
    for i in range(len(firsts)):
        for j in range(i):
            assert not firsts[i] & firsts[j]                    # no shared prefix-cache block


def test_arguments():
    assert rp.parse_range("100:1024") == (100, 1024)
    assert rp.parse_rates("4,16,64") == [4.0, 16.0, 64.0] and rp.parse_rates("") == []
    assert math.isinf(rp.parse_rates("2,inf")[1]) and rp.rate_name(math.inf) == "inf"
    for bad in ("5", "0:3", "9:2", "a:b"):
        with pytest.raises(Exception, match="LO"):
            rp.parse_range(bad)
    with pytest.raises(Exception, match="> 0"):
        rp.parse_rates("4,0")
    with pytest.raises(SystemExit):
        rp.main(["--num-requests", "2", "--", "--port", "9000"])      # the benchmark sets it
    with pytest.raises(SystemExit):
        rp.main(["--num-requests", "2", "--", "--no-such-flag"])      # serve's parser refuses


def test_engine_arguments_are_what_serve_takes_from_the_flags():
    engine, skip = rp.engine_arguments(["--max-num-seqs", "8", "--skip-tokenizer-init"])
    assert engine["max_num_seqs"] == 8 and skip is True and engine["model"] is None
    default, skip = rp.engine_arguments([])
    assert default["max_num_batched_tokens"] == engine["max_num_batched_tokens"] and not skip


def result(start, ttft, gaps, tokens, error=None) -> Result:
    """A request sent at `start` whose chunks came ttft, then gaps, later."""
    r = Result(start=start, error=error)
    t = start + ttft
    r.on_chunk("x", None, t)
    for g in gaps:
        t += g
        r.on_chunk("x", None, t)
    r.on_chunk("", {"completion_tokens": tokens, "prompt_tokens": 5}, t)
    r.end = t
    return r


def test_http_report_percentiles_throughput_and_every_request():
    results = [result(0.0, 0.1, [0.01, 0.03], 3), result(0.5, 0.3, [0.02], 2),
               result(1.0, 0.2, [], 1), Result(start=1.0, end=1.5, error="HTTP 500: boom")]
    rep = rp.http_report(results, "rate 4", rate="4", arrival_seed=0)
    assert (rep["completed"], rep["failed"], rep["salt"], rep["rate"]) == (3, 1, "rate 4", "4")
    assert rep["total_output_tokens"] == 6 and rep["duration_s"] == pytest.approx(1.5)
    assert rep["tok_per_s"] == pytest.approx(6 / 1.5)
    assert rep["ttft_ms"]["p50"] == pytest.approx(200) and rep["itl_ms"]["p50"] == pytest.approx(20)
    assert rep["tpot_ms"]["p50"] == pytest.approx(20)                  # (0.14-0.1)/2, 0.02/1
    assert rep["e2e_ms"]["p50"] == pytest.approx(200)                 # the failed one left out
    assert rep["e2e_ms"]["p99"] == pytest.approx(200 + 0.98 * 120)    # interpolated
    first = rep["requests"][0]
    assert first == {"start": 0.0, "ttft": 0.1, "e2e": 0.14, "tpot": 0.02, "itl": [0.01, 0.03],
                     "output_tokens": 3, "prompt_tokens": 5, "error": None}
    assert rep["requests"][3]["error"] == "HTTP 500: boom"


def document() -> dict:
    doc = rp.new_document(command="bench_request_path.py --num-requests 4", device="cpu",
                          revision="abc1234", dirty=False, model=None, server_flags=["--x"],
                          engine={"max_num_seqs": 256}, workload_info={"num_requests": 4},
                          client_procs=8, rates=[4.0, 16.0], env={"OMP_WAIT_POLICY": "PASSIVE"})
    doc["paths"] = {"offline": {"tok_per_s": 1000.0}, "zmq": {"tok_per_s": 950.0},
                    "http": {"tok_per_s": 800.0}}
    summary = {"p50": 12.3, "p90": 20.0, "p99": 150.0, "mean": 15.0}
    doc["rates"] = [{"rate": "4", "ttft_ms": summary, "itl_ms": summary, "tpot_ms": summary,
                     "e2e_ms": {"p50": 1500.0, "p99": 2500.0}, "tok_per_s": 321.0, "failed": 0,
                     "requests": []}]
    rp.add_ratios(doc)
    return doc


def test_the_document_records_the_run_and_survives_json():
    doc = document()
    for key in ("benchmark", "schema", "date", "device", "git_revision", "command", "model",
                "server_flags", "engine", "workload", "client_procs", "env", "paths", "rates"):
        assert key in doc
    assert doc["model"] == "default" and doc["rates_requested"] == ["4", "16"]
    assert [p["vs_offline"] for p in doc["paths"].values()] == [1.0, 0.95, 0.8]
    assert json.loads(json.dumps(doc)) == doc


def test_tables():
    text = rp.tables(document())
    lines = text.splitlines()
    assert lines[0].split("|")[0].strip() == "path" and "vs offline" in lines[0]
    assert "offline LLM.generate | 1,000.0 |       1.00" in text
    assert "ZMQ AsyncClient" in text and "0.95" in text and "0.80" in text
    row = next(line for line in lines if line.startswith("4 "))
    assert [c.strip() for c in row.split("|")] == ["4", "12.3 / 150", "12.3 / 150", "12.3",
                                                   "1,500 / 2,500", "321.0"]
    only = document()
    only["rates"] = []
    assert "TTFT" not in rp.tables(only)


def test_client_processes_send_on_schedule_and_measure():
    with fake_openai_server() as server, ClientPool(2) as pool:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        offsets = [0.0, 0.0, 0.3, 0.3, 0.6]
        results = pool.run(url, "fake-model", [[1, 2, 3]] * 4 + [[7] * 9], [8, 8, 8, 8, 9],
                           offsets, 0.6, 30.0, [[5], [6]])
    assert [r.error for r in results] == [None] * 5
    for r, offset in zip(results, offsets):
        assert offset <= r.start < offset + 0.2                  # seconds since the start
        assert 0 < r.ttft < r.end - r.start and len(r.itl) == 4 and r.tokens == 10
    assert results[4].prompt_tokens == 9
    bodies = [b for _, _, b in server.received]
    assert len(bodies) == 2 * 1 + 5                               # a warm-up per process
    timed = [b for b in bodies if b["max_tokens"] != 2]
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and
               b["ignore_eos"] is True and b["temperature"] == 0.6 and
               b["model"] == "fake-model" for b in timed)
    assert sorted(b["max_tokens"] for b in timed) == [8, 8, 8, 8, 9]
