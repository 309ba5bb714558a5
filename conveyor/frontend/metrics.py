"""Prometheus metrics of `conveyor serve`; every metric is described in docs/METRICS.md.

Per-request counters and histograms live in each frontend process and are summed across them
by prometheus_client's multiprocess mode (files under PROMETHEUS_MULTIPROC_DIR, which the
launcher sets before it spawns children). A scrape adds the scheduler's Stats, GPU use (NVML,
when installed) and the resident memory of the launcher and its children (Linux /proc).
"""
from __future__ import annotations

import glob
import os
import sys

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client import multiprocess as _mp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from conveyor.outputs import RequestOutput
from conveyor.scheduler.spec_counts import acceptance
from conveyor.shared.messages.engine import Stats

_ENV = "PROMETHEUS_MULTIPROC_DIR"
# NOTE: the classic text format (what prometheus_client serves a scraper that asks nothing);
# every Prometheus reads it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
                60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
_TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(18))          # 1 .. 131072
_FINISH_REASONS = ("stop", "length", "abort", "error")


def setup_multiprocess_dir(path: str | os.PathLike) -> None:
    """Make `path` the multiprocess folder of this process and of the children it spawns later."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    for f in glob.glob(os.path.join(path, "*.db")):
        os.remove(f)
    os.environ[_ENV] = os.fspath(path)


def mark_process_dead(pid: int) -> None:
    """Drop a dead process's live gauges (its counters stay counted); no-op without the folder."""
    path = os.environ.get(_ENV)
    if path:
        _mp.mark_process_dead(pid, path)


def finish_reason(output: RequestOutput) -> str:
    reasons = {s.finish_reason for s in output.outputs}
    if any(s.error for s in output.outputs):
        reasons.add("error")
    return next((r for r in ("error", "abort", "length") if r in reasons), "stop")


class ServerMetrics:
    """One per frontend process. Records requests; `render` answers a scrape."""

    def __init__(self, launcher_pid: int | None = None):
        self.launcher_pid = launcher_pid
        self.multiproc_dir = os.environ.get(_ENV)
        # NOTE: prometheus_client picks in-memory or file-backed values once, at its import;
        # metrics that went to memory would be missing from the other frontends' scrapes.
        if (self.multiproc_dir is not None) != (values.ValueClass is not values.MutexValue):
            raise RuntimeError(f"{_ENV} must be set before prometheus_client is imported")
        self.registry = r = CollectorRegistry()
        hist = lambda name, doc, buckets: Histogram(name, doc, buckets=buckets, registry=r)
        self.requests = Counter("conveyor_requests_total", "Finished requests.",
                                ["finish_reason"], registry=r)
        for reason in _FINISH_REASONS:
            self.requests.labels(reason)             # so every reason shows, at 0 until seen
        self.prompt_tokens = Counter("conveyor_prompt_tokens_total", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter("conveyor_generation_tokens_total",
                                         "Generated tokens.", registry=r)
        self.http = Counter("conveyor_http_requests_total", "HTTP requests answered.",
                            ["route", "status"], registry=r)
        self.ttft = hist("conveyor_time_to_first_token_seconds", "Arrival to first token.",
                         _LATENCY_BUCKETS)
        self.tpot = hist("conveyor_time_per_output_token_seconds",
                         "Mean time between output tokens.", _TPOT_BUCKETS)
        self.e2e = hist("conveyor_e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.queue = hist("conveyor_request_queue_time_seconds", "Arrival to first scheduled.",
                          _LATENCY_BUCKETS)
        self.prompt_len = hist("conveyor_request_prompt_tokens", "Prompt tokens per request.",
                               _TOKEN_BUCKETS)
        self.output_len = hist("conveyor_request_generation_tokens",
                               "Generated tokens per request.", _TOKEN_BUCKETS)
        self.gpus = _nvml_handles()

    def request_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        num_prompt = len(output.prompt_token_ids)
        num_output = sum(len(s.token_ids) for s in output.outputs)
        self.requests.labels(finish_reason(output)).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        self.prompt_len.observe(num_prompt)
        self.output_len.observe(num_output)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.num_output_tokens >= 2 and m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)

    def http_request(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def render(self, stats: Stats | None) -> tuple[bytes, str]:
        """The exposition text of every frontend's metrics plus this scrape's snapshot."""
        registry = CollectorRegistry()
        if self.multiproc_dir is not None:
            _mp.MultiProcessCollector(registry, path=self.multiproc_dir)
        else:
            registry.register(self.registry)
        registry.register(_Snapshot(self, stats))
        return generate_latest(registry), CONTENT_TYPE


class _Snapshot:
    """A collector of what is read at scrape time: Stats, GPUs, process memory."""

    def __init__(self, metrics: ServerMetrics, stats: Stats | None):
        self.metrics, self.stats = metrics, stats

    def collect(self):
        if self.stats is not None:
            yield from _stats_families(self.stats)
        if self.metrics.gpus:
            yield from _gpu_families(self.metrics.gpus)
        if self.metrics.launcher_pid is not None and sys.platform.startswith("linux"):
            yield _memory_family(self.metrics.launcher_pid)


def _stats_families(s: Stats):
    def gauge(name, doc, value):
        return GaugeMetricFamily(name, doc, value=value)

    def counter(name, doc, value):
        return CounterMetricFamily(name, doc, value=value)

    usage = 1.0 - s.num_free_blocks / s.num_total_blocks if s.num_total_blocks else 0.0
    yield gauge("conveyor_num_requests_running", "Sequences in the running batch.", s.num_running)
    yield gauge("conveyor_num_requests_waiting", "Sequences waiting to run.", s.num_waiting)
    yield gauge("conveyor_kv_cache_usage_ratio", "Share of KV cache blocks held.", usage)
    yield gauge("conveyor_kv_cache_blocks", "KV cache blocks in all.", s.num_total_blocks)
    yield counter("conveyor_prefix_cache_queries_total", "Prompt tokens looked up in the cache.",
                  s.prefix_cache_queries)
    yield counter("conveyor_prefix_cache_hits_total", "Prompt tokens found in the cache.",
                  s.prefix_cache_hits)
    yield counter("conveyor_num_preemptions_total", "Sequences preempted.", s.num_preemptions)
    yield gauge("conveyor_engine_integrity_ok", "1 when the block manager's check passes.",
                1 if s.integrity_ok else 0)
    yield gauge("conveyor_longest_wait_seconds", "Age of the oldest waiting sequence.",
                s.longest_wait_s)
    if s.queue_cap is not None:
        yield gauge("conveyor_queue_cap_requests", "Waiting sequences beyond this are refused.",
                    s.queue_cap)
    judged = CounterMetricFamily("conveyor_slo_judged_total",
                                 "Sequences whose latency objective was judged.",
                                 labels=["objective"])
    missed = CounterMetricFamily("conveyor_slo_missed_total",
                                 "Sequences that missed their latency objective.",
                                 labels=["objective"])
    for objective in ("ttft", "tpot"):
        judged.add_metric([objective], getattr(s, f"{objective}_slo_judged"))
        missed.add_metric([objective], getattr(s, f"{objective}_slo_missed"))
    yield from (judged, missed)
    yield from _spec_families(s, gauge, counter)


def _spec_families(s: Stats, gauge, counter):
    """Speculative decoding (docs/SPECULATIVE.md); zeros when it is off."""
    rate, length = acceptance(s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
                              s.spec_num_drafts)
    yield counter("conveyor_spec_decode_num_drafts_total",
                  "Sequence steps that verified guessed tokens.", s.spec_num_drafts)
    yield counter("conveyor_spec_decode_num_draft_tokens_total", "Guessed tokens verified.",
                  s.spec_num_draft_tokens)
    yield counter("conveyor_spec_decode_num_accepted_tokens_total", "Guessed tokens accepted.",
                  s.spec_num_accepted_tokens)
    yield gauge("conveyor_spec_decode_acceptance_ratio",
                "Share of guessed tokens accepted, since start.", rate)
    yield gauge("conveyor_spec_decode_mean_accepted_length",
                "Tokens a verifying sequence step yields on average, since start.", length)
    yield counter("conveyor_spec_decode_propose_seconds_total",
                  "Worker host time spent guessing tokens.", s.spec_propose_s)
    yield counter("conveyor_spec_decode_verify_steps_total", "Steps that verified guesses.",
                  s.spec_verify_steps)
    yield counter("conveyor_spec_decode_verify_seconds_total",
                  "Wall time of the steps that verified guesses.", s.spec_verify_s)


def _nvml_handles() -> list:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError:
        return []


def _gpu_families(handles: list):
    import pynvml

    util = GaugeMetricFamily("conveyor_gpu_utilization_ratio", "GPU busy time share.",
                             labels=["gpu"])
    used = GaugeMetricFamily("conveyor_gpu_memory_used_bytes", "GPU memory used.", labels=["gpu"])
    total = GaugeMetricFamily("conveyor_gpu_memory_total_bytes", "GPU memory.", labels=["gpu"])
    for i, h in enumerate(handles):
        try:
            rate, mem = pynvml.nvmlDeviceGetUtilizationRates(h), pynvml.nvmlDeviceGetMemoryInfo(h)
        except pynvml.NVMLError:
            continue
        util.add_metric([str(i)], rate.gpu / 100)
        used.add_metric([str(i)], mem.used)
        total.add_metric([str(i)], mem.total)
    yield from (util, used, total)


def _memory_family(launcher_pid: int) -> GaugeMetricFamily:
    family = GaugeMetricFamily("conveyor_process_resident_memory_bytes",
                               "Resident memory of the engine's processes.", labels=["process"])
    procs = [(launcher_pid, "conveyor::launcher")]
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and _read(f"/proc/{entry.name}/stat", _ppid) == launcher_pid:
            procs.append((int(entry.name), _read(f"/proc/{entry.name}/cmdline", _title)))
    seen = set()
    for pid, title in procs:
        rss = _read(f"/proc/{pid}/statm", lambda t: int(t.split()[1]) * os.sysconf("SC_PAGESIZE"))
        if rss is None or title is None:
            continue                                 # the process ended during the scrape
        if not title.startswith("conveyor::") or title in seen:
            title = f"{os.path.basename(title)}:{pid}"   # NOTE: label sets must stay unique
        seen.add(title)
        family.add_metric([title], rss)
    return family


def _read(path: str, parse):
    try:
        with open(path, "rb") as f:
            return parse(f.read())
    except (OSError, ValueError, IndexError):
        return None


def _ppid(stat: bytes) -> int:
    return int(stat.rsplit(b")", 1)[1].split()[1])         # after "pid (comm) state"


def _title(cmdline: bytes) -> str:
    return cmdline.split(b"\0", 1)[0].decode(errors="replace").strip()
