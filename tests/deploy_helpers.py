"""What the deploy/ tests read: the Kubernetes manifests, compose.yaml, and the names both use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
ACTOR_ROLES = ("entry", "tokenizer", "scheduler", "detokenizer")
NAMESPACE = "ringserve"


def load_docs(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of `path`."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def load_resources() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> resource, over every manifest."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for path in MANIFESTS for doc in load_docs(path)}


def load_compose() -> dict[str, Any]:
    """deploy/compose.yaml."""
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())
