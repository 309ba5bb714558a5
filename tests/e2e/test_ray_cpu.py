"""`conveyor serve --distributed-executor-backend ray` on a local Ray cluster of two nodes (a head
and a second node started beside it, one CPU and a resource of its own each, node_a and
node_b): TP 2 must span both nodes (gloo between them, CurveZMQ TCP to the scheduler) and give
the greedy tokens of one process. What can go wrong says so, and soon: Ray missing, no cluster
at RAY_ADDRESS, more workers than the cluster has CPUs or a placement that cannot be satisfied
now (each when the start-up timeout ends), and a worker actor killed while serving (its request
fails with the reason, the server exits 1). The cluster is torn down by the PIDs it started,
never with `ray stop`, which would stop every Ray cluster of this user on the machine.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from models_util import make_tiny_model
from serve_util import SMALL, run_serve, start_server

from conveyor import LLM, SamplingParams
from conveyor.client import Client
from conveyor.shared.links import free_port

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=128, vocab_size=250, max_position_embeddings=512)
PROMPTS = [[5, 17, 200, 31], list(range(40, 77)), [249, 0, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
RAY = ["--distributed-executor-backend", "ray", "--skip-tokenizer-init", "--port", "-1",
       "--device", "cpu"]


def _processes() -> dict[int, tuple[str, int]]:
    """pid -> (command line, parent pid) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            out[int(entry)] = (cmd, int(stat.rsplit(")", 1)[1].split()[1]))
    return out


def _tree(roots: set[int], procs) -> set[int]:
    found, grew = set(roots), True
    while grew:
        more = {p for p, (_, parent) in procs.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found


def _ray_start(*args: str, env: dict) -> str:
    ray = str(Path(sys.executable).parent / "ray")
    r = subprocess.run([ray, "start", "--num-cpus", "1", "--disable-usage-stats",
                        "--object-store-memory", str(80 << 20), *args],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def ray_cluster():
    """A two-node Ray cluster on this host; yields the head's address. Its temp folder is ours
    alone (short: Ray's socket paths must fit AF_UNIX), and every process that names it, with
    their descendants, is killed at the end."""
    temp = tempfile.mkdtemp(prefix="cvray-", dir="/tmp")
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    try:
        out = _ray_start("--head", "--resources", json.dumps({"node_a": 1}), "--temp-dir", temp,
                         "--port", str(free_port("127.0.0.1")), "--include-dashboard", "false",
                         "--dashboard-port", str(free_port("127.0.0.1")), env=env)
        address = re.search(r"ray start --address='([^']+)'", out).group(1)
        _ray_start("--address", address, "--resources", json.dumps({"node_b": 1}), env=env)
        yield address
    finally:
        procs = _processes()
        ours = _tree({p for p, (cmd, _) in procs.items() if temp in cmd and p != os.getpid()},
                     procs)
        for pid in ours:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["rm", "-rf", temp], check=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("ray") / "llama", **SHAPE))


def _worker_actors() -> dict[int, str]:
    """pid -> the custom resource (node_a / node_b) of the raylet that runs it, of each worker
    actor: where the operating system sees them, not where conveyor says they are."""
    procs = _processes()
    raylets = {p: re.search(r"node_[ab]", cmd).group(0) for p, (cmd, _) in procs.items()
               if "/raylet/raylet" in cmd}
    return {pid: node for raylet, node in raylets.items() for pid in _tree({raylet}, procs)
            if procs.get(pid, ("",))[0].startswith("ray::WorkerHost")}


def _served(server) -> list[list[int]]:
    """The greedy tokens of PROMPTS through the server's ZMQ port."""
    with Client(server.addresses[0], timeout=60) as client:
        return [r.outputs[0].token_ids for r in client.generate(PROMPTS, GREEDY)]


def _fails_fast(args: list[str], within_s: float = 60) -> str:
    """`conveyor serve ARGS` must exit 1 within `within_s`; its stderr."""
    started = time.monotonic()
    proc = run_serve(*SMALL, *args)
    try:
        _, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{args} hung: {proc.communicate()[1][-2000:]}")
    assert proc.returncode == 1, err
    assert time.monotonic() - started < within_s
    return err


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """One in-process engine's greedy tokens."""
    llm = LLM(model=model, skip_tokenizer_init=True, max_num_seqs=64, device="cpu",
              kv_cache_memory_bytes=64 << 20, max_model_len=512)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_tp2_over_two_ray_nodes_matches_one_process(ray_cluster, model, reference, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    server = start_server("--model", model, "--tp", "2", *RAY, timeout=120)
    try:
        placed = _worker_actors()
        assert sorted(placed.values()) == ["node_a", "node_b"], placed   # one on each node
        assert not any(t.startswith("conveyor::worker") for t in server.children)
        assert _served(server) == reference

        # both CPUs are taken: a second launch cannot be placed and says so when its start-up
        # timeout ends, not never
        err = _fails_fast(["--model", model, "--tp", "2", *RAY, "--startup-timeout", "4"])
        assert "Ray could not place tensor parallel 2" in err, err

        # a worker actor dies: the request fails with the reason (not a hang), the server exits
        with Client(server.addresses[0], timeout=60) as client:
            os.kill(next(p for p, node in placed.items() if node == "node_b"), signal.SIGKILL)
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            out = client.generate(list(range(10, 60)), long)
        assert out.finish_reason == "error" and len(out.outputs[0].token_ids) < 400
        assert re.search(r"the engine failed: worker-\d", out.error), out.error
        assert server.proc.wait(30) == 1
    finally:
        server.kill_all()


def test_bad_ray_setups_fail_at_once_saying_why(ray_cluster, model, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    # nodes may still join (a Kubernetes worker pod starts after the head): it waits for them
    # as long as its start-up timeout, then says what is missing
    err = _fails_fast(["--model", model, "--tp", "4", *RAY, "--startup-timeout", "3"])
    assert "the Ray cluster has 2 CPU over 2 node(s); tensor parallel 4 needs 4 workers" in err

    closed = f"127.0.0.1:{free_port('127.0.0.1')}"
    monkeypatch.setenv("RAY_ADDRESS", closed)
    err = _fails_fast(["--model", model, "--tp", "2", *RAY])
    assert f"no Ray cluster answers at {closed}" in err, err

    no_ray = ("import sys; sys.modules['ray'] = None; from conveyor.cli import main; "
              "sys.argv[0] = 'conveyor'; sys.exit(main())")
    r = subprocess.run([sys.executable, "-c", no_ray, "serve", "--model", model, "--tp", "2",
                        *RAY], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "pip install 'conveyor[ray]'" in r.stderr, r.stderr


def test_two_replicas_on_two_nodes_then_sigterm_leaves_no_actor(ray_cluster, model, reference,
                                                                monkeypatch):
    """-dp 2: a replica (its placement group, its TCP links, its scheduler) per node; SIGTERM
    drains, exits 0 and ends every actor."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    server = start_server("--model", model, "-dp", "2", *RAY, timeout=120)
    try:
        assert sorted(_worker_actors().values()) == ["node_a", "node_b"]
        assert _served(server) == reference
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(30) == 0
        deadline = time.monotonic() + 10     # Ray reaps a killed actor's process shortly
        while _worker_actors() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _worker_actors() == {}
    finally:
        server.kill_all()


def test_pp2_puts_a_stage_on_each_node(ray_cluster, model, reference, monkeypatch):
    """--pp 2: a placement group per stage, stage 0 on one node and stage 1 on the other,
    activations between them over gloo; the tokens of one process."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    server = start_server("--model", model, "--pp", "2", *RAY, timeout=120)
    try:
        assert sorted(_worker_actors().values()) == ["node_a", "node_b"]
        assert _served(server) == reference
    finally:
        server.kill_all()
