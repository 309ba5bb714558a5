"""The deployment files in deploy/: the Kubernetes manifest's probes, ports, GPU and shutdown
timing, and the images' command lines, which must parse with conveyor's own CLI. No docker, no
network, no cluster."""
import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from conveyor.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


def serve_flags() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {flag for action in sub.choices["serve"]._actions for flag in action.option_strings}


def parse_serve(args: list[str]):
    """`conveyor serve ARGS` through the real parser; a rejected flag fails the test by name.
    NOTE: argparse takes unambiguous prefixes (--served-model-nam), so flags must match exactly."""
    unknown = {a.split("=")[0] for a in args if a.startswith("--")} - serve_flags()
    assert not unknown, f"`conveyor serve` has no flag {sorted(unknown)}"
    try:
        return build_parser().parse_args(["serve", *args])
    except SystemExit:
        pytest.fail(f"`conveyor serve` rejects {args}")


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# ---- Kubernetes ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manifest() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert sorted(kinds) == ["Deployment", "Service"], kinds
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def pod(manifest) -> dict:
    return manifest["Deployment"]["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (c,) = pod["containers"]
    return c


def http_port(container) -> dict:
    (port,) = [p for p in container["ports"] if p.get("name") == "http"]
    return port


def test_deployment_runs_one_gpu_replica(manifest, pod, container):
    deployment = manifest["Deployment"]
    assert deployment["spec"]["replicas"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()


def test_probes_get_health_on_the_container_port(container):
    port = http_port(container)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert get["port"] in (port["containerPort"], port["name"]), probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300   # model loading


def test_container_args_parse_and_match_the_port(container):
    args = parse_serve(container["args"])
    assert args.host == "0.0.0.0"
    assert args.port == http_port(container)["containerPort"]
    assert args.device == "cuda"
    assert args.model.startswith("/models/")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "/models" in mounts and "/dev/shm" in mounts


def test_shutdown_fits_the_grace_period_and_liveness(pod, container):
    value = flag_value(container["args"], "--shutdown-timeout")
    shutdown = DEFAULT_SHUTDOWN_TIMEOUT if value is None else float(value)
    assert pod["terminationGracePeriodSeconds"] > shutdown
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > shutdown   # a drain is not a hang


def test_api_key_comes_from_a_secret(container):
    (env,) = [e for e in container["env"] if e["name"] == "CONVEYOR_API_KEY"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]


def test_pod_is_non_root_without_privilege_escalation(pod, container):
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"].get("runAsUser", 1) != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"]
    shm = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm[0]]["emptyDir"]["medium"] == "Memory"


def test_service_targets_the_container_port(manifest, container):
    service = manifest["Service"]["spec"]
    assert service.get("type", "ClusterIP") == "ClusterIP"
    pod_labels = manifest["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= pod_labels.items()
    (port,) = service["ports"]
    assert port["name"] == "http" and port["port"] == 8000
    target = http_port(container)
    assert port["targetPort"] in (target["containerPort"], target["name"])


# ---- Dockerfiles ---------------------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    pairs = []
    for line in logical:
        word, _, rest = line.strip().partition(" ")
        pairs.append((word.upper(), rest.strip()))
    return pairs


def last(pairs, name: str) -> str:
    values = [rest for word, rest in pairs if word == name]
    assert values, f"no {name}"
    return values[-1]


def command_line(path: Path) -> list[str]:
    pairs = instructions(path)
    entrypoint, cmd = json.loads(last(pairs, "ENTRYPOINT")), json.loads(last(pairs, "CMD"))
    assert entrypoint == ["conveyor", "serve"], "ENTRYPOINT must be exec form"
    return cmd


@pytest.mark.parametrize("name, device", [("Dockerfile", "auto"), ("Dockerfile.cuda", "cuda")])
def test_image_command_parses(name, device):
    path = DEPLOY / name
    args = parse_serve(command_line(path))
    assert (args.host, args.port, args.device) == ("0.0.0.0", 8000, device)
    pairs = instructions(path)
    assert str(args.port) in last(pairs, "EXPOSE").split()
    assert f":{args.port}/health" in last(pairs, "HEALTHCHECK")
    assert last(pairs, "STOPSIGNAL") == "SIGTERM"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_image_has_the_default_model_and_a_non_root_user(name):
    pairs = instructions(DEPLOY / name)
    runs = [rest for word, rest in pairs if word == "RUN"]
    assert any("conveyor fetch-default-model" in r for r in runs)
    user = last(pairs, "USER").split(":")[0]
    assert user not in ("root", "0")


def test_cpu_image_uses_the_cpu_torch_index():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"pip install \S*torch\S* --index-url https://download.pytorch.org/whl/cpu",
                     text)
    assert re.search(r"^FROM python:3\.\d+-slim|^ARG PYTHON_IMAGE=python:3\.\d+-slim", text, re.M)
    assert "pip install -e" not in text
