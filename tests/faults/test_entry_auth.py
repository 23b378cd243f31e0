"""API key (from RINGSERVE_API_KEY, never a flag) on every route but the public ones, and CORS only for the
configured origins. The key appears neither in the server's log nor on any process's command line."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Iterator
from unittest import mock

import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle, start_server

KEY = "sk-test-" + secrets.token_hex(16)
ADMIN_KEY = "sk-admin-" + secrets.token_hex(16)
ALLOWED_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with mock.patch.dict(os.environ, {"RINGSERVE_API_KEY": KEY, "RINGSERVE_ADMIN_API_KEY": ADMIN_KEY}):
        handle = start_server(str(tiny_model_dir), extra=["--max-total-tokens", "8192",
                                                          "--cors-allow-origins", ALLOWED_ORIGIN])
    yield handle
    handle.stop()


def test_requests_without_the_key_get_401(keyed_server: ServerHandle) -> None:
    base = keyed_server.base_url
    body = {"prompt": "Hi", "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                    {"authorization": "Basic " + KEY}, {"authorization": f"Bearer {KEY}x"}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/get_server_info"),
                             ("POST", "/abort_request"), ("POST", "/pause_generation")):
            response = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            error = response.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == 401
            assert KEY not in response.text
    assert httpx.get(base + "/get_server_info", timeout=30).status_code == 401


def test_operator_routes_take_the_admin_key_and_only_it(keyed_server: ServerHandle) -> None:
    base = keyed_server.base_url
    with_key, with_admin = {"authorization": f"Bearer {KEY}"}, {"authorization": f"Bearer {ADMIN_KEY}"}
    for path in ("/pause_generation", "/flush_cache", "/abort_request", "/update_weights_from_disk"):
        refused = httpx.post(base + path, json={"abort_all": True}, headers=with_key, timeout=30)
        assert refused.status_code == 401 and "admin API key" in refused.json()["error"]["message"], path
    assert httpx.get(base + "/v1/models", headers=with_admin, timeout=30).status_code == 401
    try:
        assert httpx.post(base + "/pause_generation", json={}, headers=with_admin, timeout=30).json()["success"]
        info = httpx.get(base + "/get_server_info", headers=with_key, timeout=30).json()
        assert info["paused"] is True
    finally:
        assert httpx.post(base + "/continue_generation", json={}, headers=with_admin, timeout=30).json()["success"]


def test_the_openai_client_with_the_key_works(keyed_server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=3)
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_public_routes_need_no_key(keyed_server: ServerHandle) -> None:
    assert httpx.get(keyed_server.base_url + "/health", timeout=10).status_code == 200
    assert httpx.get(keyed_server.base_url + "/openapi.json", timeout=10).json()["openapi"].startswith("3.")


def test_cors_allows_only_the_configured_origin(keyed_server: ServerHandle) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(keyed_server.base_url + "/v1/completions", timeout=10, headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})

    allowed = preflight(ALLOWED_ORIGIN)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    refused = preflight("https://evil.example")
    assert refused.headers.get("access-control-allow-origin") != "https://evil.example"


def test_the_key_is_in_no_log_and_no_command_line(keyed_server: ServerHandle) -> None:
    httpx.get(keyed_server.base_url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    httpx.get(keyed_server.base_url + "/v1/models", headers={"authorization": f"Bearer {KEY}-wrong"}, timeout=10)
    assert KEY not in keyed_server.log() and ADMIN_KEY not in keyed_server.log()
    pids = [keyed_server.proc.pid, *keyed_server.actor_pids().values()]
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert KEY not in cmdline and ADMIN_KEY not in cmdline and "api-key" not in cmdline, cmdline
    for name, pid in keyed_server.actor_pids().items():
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert (KEY.encode() in environ) == name.startswith("entry"), f"{name} sees the API key: {environ!r}"[:200]
