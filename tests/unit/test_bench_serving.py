"""benchmarks/serving.py (scripts/bench_serving.py): arrival schedule, statistics, SSE parsing,
datasets, and the whole client against a fake OpenAI server (a thread on 127.0.0.1 streaming SSE
by hand, tests/fake_openai.py)."""
import json
import math
from types import SimpleNamespace

import pytest
from fake_openai import fake_openai_server

import benchmarks.serving as bench


def test_poisson_schedule_is_seeded_with_mean_gap_one_over_rate():
    times = bench.arrival_times(20001, 4.0, seed=0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)
    assert bench.arrival_times(50, 4.0, seed=0) == times[:50]
    assert bench.arrival_times(50, 4.0, seed=1) != times[:50]
    assert bench.arrival_times(7, math.inf, seed=0) == [0.0] * 7


def test_summary_percentiles_on_known_values():
    assert bench.summarize(list(range(1, 102)), scale=1) == {
        "mean": 51.0, "p50": 51.0, "p90": 91.0, "p99": 100.0}
    assert bench.summarize([0.001, 0.003]) == pytest.approx(
        {"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98})       # seconds -> ms, interpolated
    assert bench.summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


STREAM = (b": keepalive\n\n"
          b'data: {"choices": [{"text": "a"}]}\r\n\r\n'
          b'event: message\nid: 7\ndata: {"choices":\ndata: [{"text": "bc"}]}\n\n'
          b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n'
          b'data: {"error": {"message": "boom", "code": 500}}\n\n'
          b"data: [DONE]\n\n")


@pytest.mark.parametrize("piece", [1, 3, 7, len(STREAM)])
def test_sse_decoder_on_split_reads(piece):
    decoder = bench.SSEDecoder()
    events = [e for i in range(0, len(STREAM), piece) for e in decoder.feed(STREAM[i:i + piece])]
    assert events == ['{"choices": [{"text": "a"}]}',
                      '{"choices":\n[{"text": "bc"}]}',
                      '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}',
                      '{"error": {"message": "boom", "code": 500}}',
                      "[DONE]"]
    assert decoder.close() == []
    assert decoder.feed(b"data: tail") == [] and decoder.close() == ["tail"]


def test_result_accounts_chunks_usage_done_and_errors():
    r = bench.Result(start=10.0)
    events = bench.SSEDecoder().feed(STREAM)
    assert r.on_event(events[0], "completions", now=10.5)
    assert r.on_event(events[1], "completions", now=10.7)
    assert r.on_event(events[2], "completions", now=10.9)        # usage only: no content
    r.end = 11.0
    assert (r.ttft, r.chunks, r.output_tokens, r.prompt_tokens) == (0.5, 2, 4, 3)
    assert r.itl == [pytest.approx(0.2)] and r.tpot == pytest.approx(0.5 / 3)
    assert not r.on_event("[DONE]", "completions", now=11.0) and r.ok
    assert not r.on_event(events[3], "completions", now=11.0)
    assert r.error == "error event: boom"
    chat = bench.Result(start=0.0)
    chat.on_event('{"choices": [{"delta": {"role": "assistant"}}]}', "chat", now=1.0)
    chat.on_event('{"choices": [{"delta": {"content": "hi"}}]}', "chat", now=2.0)
    assert (chat.ttft, chat.tokens) == (2.0, 1)


def test_random_dataset_lengths_within_ratio_and_seeded():
    reqs = bench.random_requests(200, 100, 20, 0.5, "completions", seed=3, min_id=5, max_id=9)
    assert all(50 <= len(r.prompt) <= 150 and 10 <= r.max_tokens <= 30 for r in reqs)
    assert len({len(r.prompt) for r in reqs}) > 20
    assert all(5 <= t <= 9 for r in reqs for t in r.prompt)
    assert reqs == bench.random_requests(200, 100, 20, 0.5, "completions", seed=3, min_id=5,
                                         max_id=9)
    assert reqs != bench.random_requests(200, 100, 20, 0.5, "completions", seed=4, min_id=5,
                                         max_id=9)
    fixed = bench.random_requests(5, 64, 8, 0.0, "completions", seed=0)
    assert {(len(r.prompt), r.max_tokens) for r in fixed} == {(64, 8)}
    chat = bench.random_requests(5, 40, 8, 0.0, "chat", seed=0)
    words = chat[0].messages[0]["content"].split()
    assert len(words) == 40 and set(words) <= set(bench.WORDS)


def test_jsonl_dataset_and_payloads(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 5}\n\n'
                    '{"prompt": [1, 2, 3]}\n'
                    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}\n')
    reqs = bench.load_jsonl(str(path), default_max_tokens=9)
    assert [(r.prompt, r.max_tokens) for r in reqs] == [("hello", 5), ([1, 2, 3], 9), (None, 7)]
    assert reqs[2].messages == [{"role": "user", "content": "hi"}]
    args = SimpleNamespace(temperature=0.0, ignore_eos=True)
    body = bench.payload(reqs[1], "completions", "m", args)
    assert body == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 9, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True}
    chat = bench.payload(reqs[0], "chat", "m", SimpleNamespace(temperature=0.0, ignore_eos=False))
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "ignore_eos" not in chat
    with pytest.raises(ValueError):
        bench.payload(reqs[1], "chat", "m", args)                 # token ids need completions
    with pytest.raises(ValueError):
        bench.payload(reqs[2], "completions", "m", args)
    (tmp_path / "bad.jsonl").write_text('{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        bench.load_jsonl(str(tmp_path / "bad.jsonl"))


@pytest.fixture
def server():
    with fake_openai_server() as httpd:
        yield httpd


def test_end_to_end_sweep_against_fake_server(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    out, png = tmp_path / "runs.jsonl", tmp_path / "latency.png"
    reports = bench.main(["--base-url", url, "--num-prompts", "4", "--sweep", "50,inf",
                          "--max-concurrency", "3", "--random-input-len", "16",
                          "--random-output-len", "8", "--output", str(out), "--plot", str(png)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == reports
    assert [r["request_rate"] for r in reports] == [50.0, "inf"]
    for rep in reports:
        assert (rep["completed"], rep["failed"], rep["model"]) == (4, 0, "fake-model")
        assert rep["total_output_tokens"] == 40 and rep["total_input_tokens"] == 64
        assert 0 < rep["ttft_ms"]["p50"] <= rep["ttft_ms"]["p99"]
        assert 0 < rep["tpot_ms"]["p50"] <= rep["tpot_ms"]["p99"]
        assert rep["itl_ms"]["p50"] <= rep["itl_ms"]["p99"] < rep["e2e_ms"]["p50"]
        assert rep["output_throughput"] > 0 and not rep["interrupted"]
    assert png.stat().st_size > 1000
    assert len(server.received) == 1 + 8                          # warm-up + 2 rates x 4
    path, _, body = server.received[-1]
    assert path == "/v1/completions" and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and len(body["prompt"]) == 16


def test_end_to_end_chat_with_failures(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
                            for text in ["hello", "fail", "reject", "again"]))
    [rep] = bench.main(["--base-url", url, "--endpoint", "chat", "--dataset", str(data),
                        "--model", "m", "--api-key", "sk-test", "--no-ignore-eos",
                        "--warmup", "0", "--request-rate", "100"])
    assert (rep["completed"], rep["failed"], rep["total_output_tokens"]) == (2, 2, 20)
    assert rep["errors"] == {"error event: boom": 1, "HTTP 400: bad request": 1}
    path, headers, body = server.received[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-test"
    assert "ignore_eos" not in body and body["max_tokens"] == 128 and body["model"] == "m"


def test_mixed_workload_sends_objectives_and_reports_each_class(server, tmp_path):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    [rep] = bench.main(["--base-url", url, "--num-prompts", "10", "--random-input-len", "16",
                        "--random-output-len", "8", "--interactive-share", "0.3",
                        "--interactive-ttft-slo", "5", "--interactive-priority", "-1",
                        "--interactive-input-len", "4", "--interactive-output-len", "2",
                        "--warmup", "0", "--seed", "7"])
    bodies = [body for _, _, body in server.received]
    interactive = [b for b in bodies if "ttft_slo" in b]
    assert len(interactive) == 3 and len(bodies) == 10
    assert all(b["ttft_slo"] == 5 and b["priority"] == -1 and len(b["prompt"]) == 4
               and b["max_tokens"] == 2 for b in interactive)
    assert all("priority" not in b and len(b["prompt"]) == 16 for b in bodies
               if "ttft_slo" not in b)
    assert rep["classes"]["interactive"]["requests"] == 3
    assert rep["classes"]["interactive"]["slo_attainment"] == 1.0      # the fake answers at once
    assert rep["classes"]["batch"] == {**rep["classes"]["batch"], "requests": 7,
                                       "completed": 7, "slo_attainment": None}
    reqs = bench.random_requests(10, 16, 8, 0.0, "completions", seed=7)
    mixed = bench.mix_interactive(reqs, 0.3, seed=7)               # seeded; these stay as they are
    assert sum(r.interactive for r in mixed) == 3 and mixed == bench.mix_interactive(reqs, 0.3, 7)
    assert [r.prompt for r in mixed] == [r.prompt for r in reqs]
    # a failed interactive request misses its objective
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
                            for text in ["hello", "fail", "reject", "again"]))
    [rep] = bench.main(["--base-url", url, "--endpoint", "chat", "--dataset", str(data),
                        "--model", "m", "--warmup", "0", "--interactive-share", "1"])
    assert rep["classes"]["interactive"]["slo_attainment"] == 0.5
    assert rep["classes"]["batch"]["requests"] == 0


def test_batch_requests_unstreamed(server):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    [rep] = bench.main(["--base-url", url, "--num-prompts", "10", "--random-input-len", "16",
                        "--random-output-len", "8", "--interactive-share", "0.3",
                        "--interactive-input-len", "4", "--interactive-ttft-slo", "5",
                        "--warmup", "0", "--no-batch-stream"])
    streamed = [b["stream"] for _, _, b in server.received]
    assert streamed.count(True) == 3 and streamed.count(False) == 7
    batch = rep["classes"]["batch"]
    assert batch["completed"] == 7 and batch["ttft_ms"]["p50"] is None
    assert rep["total_output_tokens"] == 3 * 10 + 7 * 7 and rep["failed"] == 0
    assert rep["classes"]["interactive"]["slo_attainment"] == 1.0
