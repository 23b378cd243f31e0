"""Helpers for the NATS auth tests: a probe connection that reports permission violations, TLS test certs."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client


class Probe:
    """One NATS connection as some user; tells whether the server lets it publish or subscribe a subject."""

    def __init__(self, client: Client, errors: list[str]) -> None:
        self.client = client
        self.errors = errors

    @classmethod
    async def connect(cls, url: str, creds_file: Path | None, inbox: str = "_INBOX", **options: Any) -> "Probe":
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        if creds_file is not None:
            data = json.loads(creds_file.read_text())
            options.update(user=data["user"], password=data["password"])
        client = await nats.connect(url, error_cb=on_error, inbox_prefix=inbox, allow_reconnect=False,
                                    connect_timeout=2, **options)
        return cls(client, errors)

    async def _settle(self, quiet: float = 0.3, limit: float = 5.0) -> None:
        """Flush, then wait until no new error has come for `quiet` s: the server may send a permission
        violation's -ERR after the PONG of the flush, so ordering alone proves nothing."""
        await self.client.flush(timeout=5)
        deadline = asyncio.get_running_loop().time() + limit
        seen = -1
        while seen != len(self.errors) and asyncio.get_running_loop().time() < deadline:
            seen = len(self.errors)
            await asyncio.sleep(quiet)

    def _denied(self, kind: str, subjects: list[str]) -> set[str]:
        text = "\n".join(self.errors).lower()  # nats-py lowercases -ERR texts
        self.errors.clear()
        return {s for s in subjects if f'permissions violation for {kind} to "{s}"'.lower() in text}

    async def denied_publishes(self, subjects: list[str], data: bytes = b"probe") -> set[str]:
        """Publish on each subject; the ones the server refused."""
        for subject in subjects:
            await self.client.publish(subject, data)
        await self._settle()
        return self._denied("publish", subjects)

    async def denied_subscriptions(self, subjects: list[str]) -> set[str]:
        """Subscribe each subject (then unsubscribe); the ones the server refused."""
        subs = [await self.client.subscribe(subject) for subject in subjects]
        await self._settle()
        for sub in subs:
            await sub.unsubscribe()
        return self._denied("subscription", subjects)

    async def can_publish(self, subject: str, data: bytes = b"probe") -> bool:
        return not await self.denied_publishes([subject], data)

    async def can_subscribe(self, subject: str) -> bool:
        return not await self.denied_subscriptions([subject])

    async def close(self) -> None:
        await self.client.close()


async def next_message(sub: Any, timeout: float) -> Any | None:
    """The subscription's next message, or None within `timeout` seconds."""
    try:
        return await sub.next_msg(timeout=timeout)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return None


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (needs `openssl`)."""
    if shutil.which("openssl") is None:
        import pytest
        pytest.skip("openssl not installed")
    names = ("ca", "ca_key", "server", "server_key", "csr", "client", "client_key", "client_csr")
    files = {name: directory / f"{name}.pem" for name in names}
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *argv: subprocess.run(["openssl", *argv], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", str(files["ca_key"]), "-out", str(files["ca"]), "-days", "1",
        "-subj", "/CN=ringserve-test-ca")
    run("req", *ec, "-keyout", str(files["server_key"]), "-out", str(files["csr"]), "-subj", "/CN=localhost")
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", str(files["csr"]), "-CA", str(files["ca"]), "-CAkey", str(files["ca_key"]),
        "-CAcreateserial", "-out", str(files["server"]), "-days", "1", "-extfile", str(ext))
    run("req", *ec, "-keyout", str(files["client_key"]), "-out", str(files["client_csr"]), "-subj", "/CN=ringserve")
    run("x509", "-req", "-in", str(files["client_csr"]), "-CA", str(files["ca"]), "-CAkey", str(files["ca_key"]),
        "-CAcreateserial", "-out", str(files["client"]), "-days", "1")
    return files


def tls_block(files: dict[str, Path]) -> str:
    """nats-server config requiring TLS with a client certificate signed by the test CA (mutual TLS)."""
    return (f'tls {{\n  cert_file: "{files["server"]}"\n  key_file: "{files["server_key"]}"\n'
            f'  ca_file: "{files["ca"]}"\n  verify: true\n}}\n')
