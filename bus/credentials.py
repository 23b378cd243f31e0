"""How a process authenticates to NATS: user/password, a NATS `.creds` file, TLS; never on a command line.

Credentials come from a file whose path may be on the command line (`--nats-creds FILE`) or from a user name
plus the password in the environment variable `RINGSERVE_NATS_PASSWORD` (`--nats-user NAME`). A credentials
file is either

- ringserve's JSON: `{"user": "...", "password": "..."}` (other keys, such as the subjects the launcher
  notes for a client, are ignored), or
- a NATS `.creds` file (a user JWT and nkey seed, as `nsc` writes it; needs the PyPI package `nkeys`).

`ringserve serve` writes JSON files (mode 0600, in a private 0700 directory) for the actors it starts.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PASSWORD_ENV = "RINGSERVE_NATS_PASSWORD"
NATS_CREDS_MARKER = "-----BEGIN NATS USER JWT-----"


class CredentialsError(ValueError):
    """A credentials file or option that cannot be used."""


@dataclass(frozen=True)
class NatsCredentials:
    """Everything a NATS connection needs to authenticate; the password never shows in repr()."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    creds_file: str | None = None  # a NATS .creds file (JWT + nkey seed)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect`."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options["user"] = self.user
            options["password"] = self.password or ""
        if self.creds_file is not None:
            options["user_credentials"] = self.creds_file
        tls = self.ssl_context()
        if tls is not None:
            options["tls"] = tls
        return options

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context when any TLS option is set (CA to verify the server; cert+key for mutual TLS)."""
        if not (self.tls_ca or self.tls_cert or self.tls_key):
            return None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise CredentialsError("--nats-tls-cert and --nats-tls-key go together")
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert and self.tls_key:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context


def load_credentials_file(path: str | Path) -> NatsCredentials:
    """Read a ringserve JSON credentials file or a NATS .creds file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CredentialsError(f"cannot read NATS credentials {path}: {exc.strerror}") from exc
    if NATS_CREDS_MARKER in text:
        return NatsCredentials(creds_file=str(path))
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CredentialsError(f"{path} is neither a NATS .creds file nor ringserve JSON credentials") from exc
    if not isinstance(data, dict) or not isinstance(data.get("user"), str) or not isinstance(data.get("password"), str):
        raise CredentialsError(f'{path}: JSON credentials need string fields "user" and "password"')
    return NatsCredentials(user=data["user"], password=data["password"])


def write_credentials_file(path: str | Path, user: str, password: str, **extra: Any) -> Path:
    """Write JSON credentials readable only by this user (0600); `extra` keys are notes for the reader."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"user": user, "password": password, **extra}, out, indent=2)
    return path


def credentials_from_options(creds: str | None = None, user: str | None = None, tls_ca: str | None = None,
                             tls_cert: str | None = None, tls_key: str | None = None,
                             environ: dict[str, str] | None = None) -> NatsCredentials | None:
    """Credentials from command-line options (`--nats-creds`, `--nats-user` + $RINGSERVE_NATS_PASSWORD, TLS).

    None when no option is set: an unauthenticated connection.
    """
    env = os.environ if environ is None else environ
    if creds and user:
        raise CredentialsError("give --nats-creds or --nats-user, not both")
    base = load_credentials_file(creds) if creds else NatsCredentials()
    if user:
        password = env.get(PASSWORD_ENV)
        if password is None:
            raise CredentialsError(f"--nats-user needs the password in the environment variable {PASSWORD_ENV}")
        base = NatsCredentials(user=user, password=password)
    result = NatsCredentials(user=base.user, password=base.password, creds_file=base.creds_file,
                             tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
    if result == NatsCredentials():
        return None
    result.ssl_context()  # fail early on half-given TLS options
    return result
