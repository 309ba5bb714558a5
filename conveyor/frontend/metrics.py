"""Prometheus metrics of `conveyor serve`; every metric is described in docs/METRICS.md.

Names are `conveyor:<name>`; where vLLM has a series of the same meaning, <name> is vLLM's (so a
vLLM dashboard works after replacing `vllm:` with `conveyor:`). Every series carries the label
`model_name` (the first served model name). Per-request counters and histograms live in each
frontend process and are summed across them by prometheus_client's multiprocess mode (files under
PROMETHEUS_MULTIPROC_DIR, which the launcher sets before it spawns children). A scrape adds the
scheduler's Stats, GPU use (NVML, when installed) and the resident memory of the launcher and its
children (Linux /proc).
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

    def __init__(self, model_name: str = "", launcher_pid: int | None = None):
        self.model_name, self.launcher_pid = model_name, launcher_pid
        self.multiproc_dir = os.environ.get(_ENV)
        # NOTE: prometheus_client picks in-memory or file-backed values once, at its import;
        # metrics that went to memory would be missing from the other frontends' scrapes.
        if (self.multiproc_dir is not None) != (values.ValueClass is not values.MutexValue):
            raise RuntimeError(f"{_ENV} must be set before prometheus_client is imported")
        self.registry = r = CollectorRegistry()
        model = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, model, buckets=buckets, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, model, registry=r).labels(model_name)

        self.requests = Counter("conveyor:request_success", "Finished requests.",
                                ["model_name", "finished_reason"], registry=r)
        for reason in _FINISH_REASONS:
            self.requests.labels(model_name, reason)    # so every reason shows, at 0 until seen
        self.prompt_tokens = counter("conveyor:prompt_tokens", "Prompt tokens.")
        self.generation_tokens = counter("conveyor:generation_tokens", "Generated tokens.")
        self.http = Counter("conveyor:http_requests", "HTTP requests answered.",
                            ["model_name", "route", "status"], registry=r)
        self.ttft = hist("conveyor:time_to_first_token_seconds", "Arrival to first token.",
                         _LATENCY_BUCKETS)
        self.itl = hist("conveyor:inter_token_latency_seconds",
                        "Time between two outputs of a sequence.", _TPOT_BUCKETS)
        self.tpot = hist("conveyor:request_time_per_output_token_seconds",
                         "A request's mean time between output tokens.", _TPOT_BUCKETS)
        self.e2e = hist("conveyor:e2e_request_latency_seconds", "Arrival to finish.",
                        _E2E_BUCKETS)
        self.queue = hist("conveyor:request_queue_time_seconds", "Arrival to first scheduled.",
                          _LATENCY_BUCKETS)
        self.prompt_len = hist("conveyor:request_prompt_tokens", "Prompt tokens per request.",
                               _TOKEN_BUCKETS)
        self.output_len = hist("conveyor:request_generation_tokens",
                               "Generated tokens per request.", _TOKEN_BUCKETS)
        self.gpus = _nvml_handles()

    def request_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        num_prompt = len(output.prompt_token_ids)
        num_output = sum(len(s.token_ids) for s in output.outputs)
        self.requests.labels(self.model_name, finish_reason(output)).inc()
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

    def inter_token(self, seconds: float) -> None:
        """A sequence's new tokens came `seconds` after its previous ones."""
        self.itl.observe(seconds)

    def http_request(self, route: str, status: int) -> None:
        self.http.labels(self.model_name, route, str(status)).inc()

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
        model = self.metrics.model_name
        if self.stats is not None:
            yield from _stats_families(self.stats, model)
        if self.metrics.gpus:
            yield from _gpu_families(self.metrics.gpus, model)
        if self.metrics.launcher_pid is not None and sys.platform.startswith("linux"):
            yield _memory_family(self.metrics.launcher_pid, model)


def _stats_families(stats: Stats, model: str):
    """The engine's figures; with data-parallel replicas, one series per live replica (label
    `replica`) and conveyor:replica_up for each."""
    rows = [({"replica": str(r.replica)}, r) for r in stats.replicas] or [({}, stats)]
    extra = list(rows[0][0])

    def family(kind, name, doc, value):
        f = kind(name, doc, labels=["model_name", *extra])
        for labels, s in rows:
            f.add_metric([model, *labels.values()], value(s))
        return f

    def gauge(name, doc, value):
        return family(GaugeMetricFamily, name, doc, value)

    def counter(name, doc, value):
        return family(CounterMetricFamily, name, doc, value)

    if stats.replicas:
        up = GaugeMetricFamily("conveyor:replica_up", "1 while a data-parallel replica serves.",
                               labels=["model_name", "replica"])
        for r in sorted([s.replica for s in stats.replicas] + stats.dead_replicas):
            up.add_metric([model, str(r)], 0 if r in stats.dead_replicas else 1)
        yield up
    yield gauge("conveyor:num_requests_running", "Sequences in the running batch.",
                lambda s: s.num_running)
    yield gauge("conveyor:num_requests_waiting", "Sequences waiting to run.",
                lambda s: s.num_waiting)
    yield gauge("conveyor:kv_cache_usage_perc", "Share of KV cache blocks held, 0 to 1.",
                lambda s: 1.0 - s.num_free_blocks / s.num_total_blocks
                if s.num_total_blocks else 0.0)
    yield gauge("conveyor:kv_cache_blocks", "KV cache blocks in all.",
                lambda s: s.num_total_blocks)
    yield counter("conveyor:prefix_cache_queries_total", "Prompt tokens looked up in the cache.",
                  lambda s: s.prefix_cache_queries)
    yield counter("conveyor:prefix_cache_hits_total", "Prompt tokens found in the cache.",
                  lambda s: s.prefix_cache_hits)
    yield counter("conveyor:num_preemptions_total", "Sequences preempted.",
                  lambda s: s.num_preemptions)
    yield gauge("conveyor:engine_integrity_ok", "1 when the block manager's check passes.",
                lambda s: 1 if s.integrity_ok else 0)
    yield gauge("conveyor:longest_wait_seconds", "Age of the oldest waiting sequence.",
                lambda s: s.longest_wait_s)
    if stats.queue_cap is not None:
        yield gauge("conveyor:queue_cap_requests", "Waiting sequences beyond this are refused.",
                    lambda s: s.queue_cap or 0)
    for what, doc in (("judged", "Sequences whose latency objective was judged."),
                      ("missed", "Sequences that missed their latency objective.")):
        f = CounterMetricFamily(f"conveyor:slo_{what}_total", doc,
                                labels=["model_name", "objective", *extra])
        for objective in ("ttft", "tpot"):
            for labels, s in rows:
                f.add_metric([model, objective, *labels.values()],
                             getattr(s, f"{objective}_slo_{what}"))
        yield f
    yield from _spec_families(gauge, counter)


def _spec_families(gauge, counter):
    """Speculative decoding (docs/SPECULATIVE.md); zeros when it is off."""
    def rates(s: Stats):
        return acceptance(s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_num_drafts)

    yield counter("conveyor:spec_decode_num_drafts_total",
                  "Sequence steps that verified guessed tokens.", lambda s: s.spec_num_drafts)
    yield counter("conveyor:spec_decode_num_draft_tokens_total", "Guessed tokens verified.",
                  lambda s: s.spec_num_draft_tokens)
    yield counter("conveyor:spec_decode_num_accepted_tokens_total", "Guessed tokens accepted.",
                  lambda s: s.spec_num_accepted_tokens)
    yield gauge("conveyor:spec_decode_acceptance_ratio",
                "Share of guessed tokens accepted, since start.", lambda s: rates(s)[0])
    yield gauge("conveyor:spec_decode_mean_accepted_length",
                "Tokens a verifying sequence step yields on average, since start.",
                lambda s: rates(s)[1])
    yield counter("conveyor:spec_decode_propose_seconds_total",
                  "Worker host time spent guessing tokens.", lambda s: s.spec_propose_s)
    yield counter("conveyor:spec_decode_verify_steps_total", "Steps that verified guesses.",
                  lambda s: s.spec_verify_steps)
    yield counter("conveyor:spec_decode_verify_seconds_total",
                  "Wall time of the steps that verified guesses.", lambda s: s.spec_verify_s)
    yield counter("conveyor:structured_output_steps_total",
                  "Steps that sampled rows under a structured-output bitmask.",
                  lambda s: s.structured_steps)
    yield counter("conveyor:structured_output_rows_total",
                  "Rows sampled under a structured-output bitmask.", lambda s: s.structured_rows)
    yield counter("conveyor:structured_output_fill_seconds_total",
                  "Time spent advancing matchers and filling bitmasks (worker rank 0, mostly "
                  "on its fill thread).", lambda s: s.structured_fill_s)
    yield counter("conveyor:structured_output_wait_seconds_total",
                  "Time the step loop waited for a bitmask.", lambda s: s.structured_wait_s)


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


def _gpu_families(handles: list, model: str):
    import pynvml

    labels = ["model_name", "gpu"]
    util = GaugeMetricFamily("conveyor:gpu_utilization_ratio", "GPU busy time share.",
                             labels=labels)
    used = GaugeMetricFamily("conveyor:gpu_memory_used_bytes", "GPU memory used.", labels=labels)
    total = GaugeMetricFamily("conveyor:gpu_memory_total_bytes", "GPU memory.", labels=labels)
    for i, h in enumerate(handles):
        try:
            rate, mem = pynvml.nvmlDeviceGetUtilizationRates(h), pynvml.nvmlDeviceGetMemoryInfo(h)
        except pynvml.NVMLError:
            continue
        util.add_metric([model, str(i)], rate.gpu / 100)
        used.add_metric([model, str(i)], mem.used)
        total.add_metric([model, str(i)], mem.total)
    yield from (util, used, total)


def _memory_family(launcher_pid: int, model: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily("conveyor:process_resident_memory_bytes",
                               "Resident memory of the engine's processes.",
                               labels=["model_name", "process"])
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
        family.add_metric([model, title], rss)
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
