"""Prometheus metrics: sums across frontend processes (multiprocess mode, run in subprocesses so
this process's prometheus_client stays in-memory), the Stats snapshot, GPUs (a fake NVML) and
the /proc memory of the launcher's children."""
import inspect
import json
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.frontend.metrics import (
    ServerMetrics,
    finish_reason,
    mark_process_dead,
    setup_multiprocess_dir,
)
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.shared.messages.engine import Stats

ROOT = Path(__file__).resolve().parents[2]
ENV = "PROMETHEUS_MULTIPROC_DIR"


def make_output(num_prompt, samples, ttft=0.5, queue=0.25, e2e=2.0, error=None):
    """A finished request; samples: [(finish_reason, num_tokens)]; ttft/queue None: never got
    there. Arrival is at t=100."""
    from conveyor.outputs import CompletionOutput, RequestMetrics, RequestOutput

    outs = [CompletionOutput(i, "x" * n, list(range(n)), finish_reason=r, error=error)
            for i, (r, n) in enumerate(samples)]
    num_output = sum(n for _, n in samples)
    m = RequestMetrics(arrival_time=100.0, finished_time=100.0 + e2e, num_output_tokens=num_output,
                       first_scheduled_time=None if queue is None else 100.0 + queue,
                       first_token_time=None if ttft is None else 100.0 + ttft)
    return RequestOutput("r", None, list(range(num_prompt)), outs, finished=True, metrics=m)


def samples(text: str) -> dict:
    """{(sample name, frozenset of labels): value} of an exposition text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run_python(code: str, env: dict, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


FRONTEND = inspect.getsource(make_output) + """
import json, sys
from conveyor.frontend.metrics import ServerMetrics

m = ServerMetrics("m")
spec = json.loads(sys.argv[1])
for kwargs in spec["requests"]:
    m.request_finished(make_output(**kwargs))
for route, status in spec["http"]:
    m.http_request(route, status)
"""

RENDER = """
import sys
from conveyor.frontend.metrics import ServerMetrics
from conveyor.shared.messages import Stats

body, content_type = ServerMetrics("m").render(Stats(num_running=2, num_total_blocks=8))
assert content_type.startswith("text/plain"), content_type
sys.stdout.write(body.decode())
"""


def test_counters_and_histograms_sum_across_frontend_processes(tmp_path):
    prom_dir = tmp_path / "prom"
    env = dict(os.environ, **{ENV: str(prom_dir)})
    prom_dir.mkdir()
    frontend_0 = {
        "requests": [dict(num_prompt=4, samples=[("stop", 3)]),
                     dict(num_prompt=4, samples=[("stop", 5)]),
                     dict(num_prompt=10, samples=[("length", 8), ("stop", 8)])],
        "http": [["/v1/completions", 200], ["/v1/completions", 200], ["/v1/completions", 400]],
    }
    frontend_1 = {
        "requests": [dict(num_prompt=2, samples=[("stop", 1)]),
                     dict(num_prompt=7, samples=[("error", 0)], ttft=None, queue=None,
                          error="engine died")],
        "http": [["/v1/completions", 200], ["/v1/chat/completions", 500]],
    }
    run_python(FRONTEND, env, json.dumps(frontend_0))
    run_python(FRONTEND, env, json.dumps(frontend_1))
    assert len(list(prom_dir.glob("*.db"))) >= 2          # files of both frontends

    got = samples(run_python(RENDER, env))

    def value(name, **labels):
        return got[(name, frozenset({**labels, "model_name": "m"}.items()))]

    assert value("conveyor:request_success_total", finished_reason="stop") == 3
    assert value("conveyor:request_success_total", finished_reason="length") == 1
    assert value("conveyor:request_success_total", finished_reason="error") == 1
    assert value("conveyor:request_success_total", finished_reason="abort") == 0
    assert value("conveyor:prompt_tokens_total") == 4 + 4 + 10 + 2 + 7
    assert value("conveyor:generation_tokens_total") == 3 + 5 + 16 + 1 + 0
    assert value("conveyor:http_requests_total", route="/v1/completions", status="200") == 3
    assert value("conveyor:http_requests_total", route="/v1/completions", status="400") == 1
    assert value("conveyor:http_requests_total", route="/v1/chat/completions", status="500") == 1
    # the errored request never got a first token nor a schedule; one-token requests have no TPOT
    assert value("conveyor:time_to_first_token_seconds_count") == 4
    assert value("conveyor:time_to_first_token_seconds_sum") == pytest.approx(4 * 0.5)
    assert value("conveyor:request_queue_time_seconds_count") == 4
    assert value("conveyor:request_time_per_output_token_seconds_count") == 3
    assert value("conveyor:e2e_request_latency_seconds_count") == 5
    assert value("conveyor:e2e_request_latency_seconds_sum") == pytest.approx(5 * 2.0)
    assert value("conveyor:request_generation_tokens_count") == 5
    assert value("conveyor:request_generation_tokens_bucket", le="4.0") == 3   # 3, 1 and 0
    assert value("conveyor:request_prompt_tokens_bucket", le="8.0") == 4      # all but the 10
    # the snapshot of the Stats comes along
    assert value("conveyor:num_requests_running") == 2
    assert value("conveyor:kv_cache_usage_perc") == 1.0                      # 0 of 8 free


def test_metrics_recorded_before_the_folder_was_set_are_refused(tmp_path):
    code = ("import os, prometheus_client\n"
            f"os.environ[{ENV!r}] = {str(tmp_path)!r}\n"
            "from conveyor.frontend.metrics import ServerMetrics\n"
            "try:\n    ServerMetrics()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != ENV}
    assert run_python(code, env).startswith(f"refused: {ENV} must be set")


def test_setup_multiprocess_dir_and_mark_process_dead(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "")                              # restored after the test
    monkeypatch.delenv(ENV)
    mark_process_dead(12345)                                 # no folder: a no-op, no error
    path = tmp_path / "a" / "prom"
    setup_multiprocess_dir(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert os.environ[ENV] == str(path)
    (path / "counter_999.db").write_bytes(b"stale")
    (path / "gauge_livesum_777.db").write_bytes(b"live")
    (path / "keep.txt").write_text("not ours")
    mark_process_dead(777)
    assert sorted(p.name for p in path.iterdir()) == ["counter_999.db", "keep.txt"]
    setup_multiprocess_dir(path)                             # a second launch starts clean
    assert sorted(p.name for p in path.iterdir()) == ["keep.txt"]


def test_request_finish_reason_priority():
    def out(*samples):
        outs = [CompletionOutput(i, "", [], finish_reason=r, error=e)
                for i, (r, e) in enumerate(samples)]
        return RequestOutput("r", None, [1], outs)

    assert finish_reason(out(("stop", None), ("stop", None))) == "stop"
    assert finish_reason(out(("stop", None), ("length", None))) == "length"
    assert finish_reason(out(("length", None), ("abort", None))) == "abort"
    assert finish_reason(out(("abort", None), ("error", "boom"))) == "error"
    assert finish_reason(out(("abort", "worker died"))) == "error"   # an error wins over its reason


def test_single_process_render_of_requests_and_stats():
    m = ServerMetrics("m")
    m.request_finished(make_output(6, [("stop", 4)], ttft=0.03))
    m.inter_token(0.02)
    m.http_request("/v1/completions", 200)
    stats = Stats(num_running=3, num_waiting=2, num_free_blocks=25, num_total_blocks=100,
                  prefix_cache_queries=40, prefix_cache_hits=10, num_preemptions=7,
                  integrity_ok=False, longest_wait_s=4.5, queue_cap=64, ttft_slo_judged=9,
                  ttft_slo_missed=2, tpot_slo_judged=5, tpot_slo_missed=1)
    body, content_type = m.render(stats)
    got = samples(body.decode())
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"

    def value(name, **labels):
        return got[(name, frozenset({**labels, "model_name": "m"}.items()))]

    assert value("conveyor:request_success_total", finished_reason="stop") == 1
    assert value("conveyor:generation_tokens_total") == 4
    assert value("conveyor:time_to_first_token_seconds_sum") == pytest.approx(0.03)
    assert value("conveyor:time_to_first_token_seconds_bucket", le="0.025") == 0
    assert value("conveyor:time_to_first_token_seconds_bucket", le="0.05") == 1
    # (finished - first token) / (tokens - 1) = (2.0 - 0.03) / 3
    assert value("conveyor:request_time_per_output_token_seconds_sum") == pytest.approx(1.97 / 3)
    assert value("conveyor:http_requests_total", route="/v1/completions", status="200") == 1
    assert value("conveyor:inter_token_latency_seconds_bucket", le="0.015") == 0
    assert value("conveyor:inter_token_latency_seconds_bucket", le="0.02") == 1
    assert value("conveyor:num_requests_running") == 3
    assert value("conveyor:num_requests_waiting") == 2
    assert value("conveyor:kv_cache_usage_perc") == pytest.approx(0.75)
    assert value("conveyor:kv_cache_blocks") == 100
    assert value("conveyor:prefix_cache_queries_total") == 40
    assert value("conveyor:prefix_cache_hits_total") == 10
    assert value("conveyor:num_preemptions_total") == 7
    assert value("conveyor:engine_integrity_ok") == 0
    assert value("conveyor:longest_wait_seconds") == 4.5
    assert value("conveyor:queue_cap_requests") == 64
    assert value("conveyor:slo_judged_total", objective="ttft") == 9
    assert value("conveyor:slo_missed_total", objective="ttft") == 2
    assert value("conveyor:slo_judged_total", objective="tpot") == 5
    assert value("conveyor:slo_missed_total", objective="tpot") == 1

    model = frozenset({("model_name", "m")})
    assert samples(m.render(Stats())[0].decode())[("conveyor:kv_cache_usage_perc", model)] == 0.0
    names = {name for name, _ in samples(m.render(None)[0].decode())}
    assert "conveyor:request_success_total" in names
    assert not any(n.startswith(("conveyor:num_", "conveyor:kv_", "conveyor:prefix_",
                                 "conveyor:engine_", "conveyor:process_", "conveyor:slo_",
                                 "conveyor:longest_", "conveyor:queue_")) for n in names)
    no_cap = samples(m.render(Stats())[0].decode())
    assert ("conveyor:queue_cap_requests", model) not in no_cap
    # every series carries the model's name
    assert all(dict(labels).get("model_name") == "m"
               for _, labels in samples(m.render(Stats(queue_cap=3))[0].decode()))


def test_gpu_metrics_from_nvml(monkeypatch):
    class NVMLError(Exception):
        pass

    def memory(h):
        if h == "lost":
            raise NVMLError("GPU is lost")
        return types.SimpleNamespace(used=3 << 30, total=80 << 30)

    fake = types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: ["ok", "lost"][i],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=42, memory=0),
        nvmlDeviceGetMemoryInfo=memory)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    got = samples(ServerMetrics().render(None)[0].decode())
    gpu = {name: v for (name, labels), v in got.items() if name.startswith("conveyor:gpu_")
           and labels == frozenset({("gpu", "0"), ("model_name", "")})}
    assert gpu == {"conveyor:gpu_utilization_ratio": 0.42,
                   "conveyor:gpu_memory_used_bytes": 3 << 30,
                   "conveyor:gpu_memory_total_bytes": 80 << 30}
    assert not any(("gpu", "1") in labels for _, labels in got)   # the lost GPU is skipped

    def no_driver():
        raise NVMLError("driver not loaded")

    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    m = ServerMetrics()
    assert m.gpus == []
    assert not any(n.startswith("conveyor:gpu_") for n, _ in samples(m.render(None)[0].decode()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_resident_memory_of_the_launcher_and_its_children():
    titled = subprocess.Popen(
        [sys.executable, "-c", "import setproctitle, sys; setproctitle.setproctitle("
         "'conveyor::worker-0'); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen(["sleep", "60"])
    try:
        assert titled.stdout.readline() == "ready\n"
        got = samples(ServerMetrics(launcher_pid=os.getpid()).render(None)[0].decode())
        rss = {dict(labels)["process"]: v for (name, labels), v in got.items()
               if name == "conveyor:process_resident_memory_bytes"}
        assert rss["conveyor::launcher"] > 10 << 20            # this pytest process
        assert rss["conveyor::worker-0"] > 1 << 20             # a python interpreter
        assert rss[f"sleep:{plain.pid}"] > 0
        assert f"conveyor::worker-0:{titled.pid}" not in rss
    finally:
        plain.kill()
        titled.stdin.close()
        titled.wait(timeout=10)
        plain.wait(timeout=10)
