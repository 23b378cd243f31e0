"""NATS auth without a server: every subject has a permitted user, scoped client rids route to the client's
subjects and cannot be forged, and the launcher keeps credentials off command lines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ringserve.actors.launcher.nats_auth import plan_nats
from ringserve.bus.permissions import ROLES, client_permissions, role_permissions
from ringserve.bus.subjects import InvalidRidError, Subjects, scoped_rid, validate_rid, validate_ring_rid

NS = "auth"


def matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` is one token, a final `>` one or more."""
    p, s = pattern.split("."), subject.split(".")
    if p[-1] == ">":
        return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s))
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))


def test_every_subject_in_the_table_has_a_permitted_publisher_and_subscriber() -> None:
    """A subject added to bus/subjects.py without a role allowed to use it fails here, not in production."""
    subjects = Subjects(NS)
    concrete = {name: value for name in dir(subjects) if not name.startswith("_")
                and isinstance(value := getattr(subjects, name), str) and "*" not in value and name != "namespace"}
    concrete |= {"tokens": subjects.tokens(0), "output": subjects.output("r"), "abort": subjects.abort("r"),
                 "client_submit": subjects.client_submit("alice"), "client_output": subjects.output("alice~r"),
                 "client_abort": subjects.abort("alice~r"),
                 **{f"spans_{role}": subjects.spans(role)
                    for role in ("entry", "tokenizer", "scheduler", "detokenizer")}}
    perms = [role_permissions(NS, r) for r in ROLES] + [client_permissions(NS, "alice")]
    for name, subject in concrete.items():
        assert any(matches(p, subject) for x in perms for p in x.publish), f"nobody may publish {name}"
        assert any(matches(p, subject) for x in perms for p in x.subscribe), f"nobody may subscribe {name}"


def test_scoped_rids_route_to_their_clients_subjects_and_cannot_be_forged_from_outside() -> None:
    s = Subjects(NS)
    rid = scoped_rid("alice", "r1")
    assert rid == "alice~r1" and validate_ring_rid(rid) == rid
    assert s.output(rid) == f"{NS}.client.alice.out.r1" and s.abort(rid) == f"{NS}.client.alice.abort.r1"
    assert s.rid_of(f"{NS}.client.alice.abort.r1") == rid and s.rid_of(f"{NS}.abort.r1") == "r1"
    for forged in ("alice~r1", "a~b~c", "~r", "a~"):
        with pytest.raises(InvalidRidError):
            validate_rid(forged)  # what the entry and the unscoped submit path accept
    for bad in ("a~b~c", "~r", "a~", "a.b~c", "a~b.c"):
        with pytest.raises(InvalidRidError):
            validate_ring_rid(bad)


def serve_args(**given: object) -> argparse.Namespace:
    names = ("nats_url", "nats_creds", "nats_creds_dir", "nats_user", "nats_tls_ca", "nats_tls_cert", "nats_tls_key")
    return argparse.Namespace(**{**{name: None for name in names}, "nats_client": [], **given})


def test_credentials_in_the_url_move_into_a_private_file() -> None:
    plan = plan_nats(serve_args(nats_url="nats://ring:s3cr%40t@127.0.0.1:4222"), NS)
    try:
        assert plan.url == "nats://127.0.0.1:4222"
        argv = plan.role_args("entry")
        assert "s3cr" not in " ".join(argv) and argv[0] == "--nats-creds"
        assert json.loads(Path(argv[1]).read_text()) == {"user": "ring", "password": "s3cr@t"}
        assert Path(argv[1]).parent.stat().st_mode & 0o777 == 0o700
        assert plan.launcher_credentials is not None and plan.launcher_credentials.password == "s3cr@t"
    finally:
        plan.cleanup()
    assert not Path(argv[1]).exists()


def test_auth_flags_that_clash_are_refused() -> None:
    with pytest.raises(ValueError, match="need --nats-url"):
        plan_nats(serve_args(nats_user="u"), NS)
    with pytest.raises(ValueError, match="--nats-client"):
        plan_nats(serve_args(nats_url="nats://127.0.0.1:1", nats_client=["c"]), NS)
    with pytest.raises(ValueError, match="one of"):
        plan_nats(serve_args(nats_url="nats://127.0.0.1:1", nats_creds="a", nats_user="u"), NS)
