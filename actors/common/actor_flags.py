"""The flags actor processes share, declared once as dataclass fields (actors/common/flag_fields.py): every
actor's bus, namespace, log level, drain timeout, NATS credentials and tracing (the credential and tracing flags
are `ringserve serve`'s too).

Secrets never travel as flags: a password comes from a file (`--nats-creds`) or `$RINGSERVE_NATS_PASSWORD`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from ringserve.actors.common import flag_fields
from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import NATS, PROCESS
from ringserve.bus.credentials import PASSWORD_ENV, NatsCredentials, credentials_from_options
from ringserve.observability.tracing_config import TracingFlags

DEFAULT_DRAIN_SECONDS = 30.0


@dataclass
class NatsAuthFlags:
    """How to authenticate to NATS (none given: unauthenticated)."""

    nats_creds: str | None = field(default=None, metadata=flag(
        'NATS credentials: a NATS .creds file or JSON {"user": ..., "password": ...}', group=NATS, metavar="FILE"))
    nats_user: str | None = field(default=None, metadata=flag(
        f"NATS user name; the password is read from ${PASSWORD_ENV}", group=NATS))
    nats_tls_ca: str | None = field(default=None, metadata=flag(
        "CA bundle that verifies the NATS server", group=NATS, metavar="FILE"))
    nats_tls_cert: str | None = field(default=None, metadata=flag(
        "client certificate for mutual TLS", group=NATS, metavar="FILE"))
    nats_tls_key: str | None = field(default=None, metadata=flag(
        "private key of --nats-tls-cert", group=NATS, metavar="FILE"))

    def credentials(self) -> NatsCredentials | None:
        """The credentials these flags describe (raises CredentialsError for unusable ones)."""
        return credentials_from_options(self.nats_creds, self.nats_user, self.nats_tls_ca, self.nats_tls_cert,
                                        self.nats_tls_key)


@dataclass
class BusFlags:
    """What every actor process is started with, besides its credentials and tracing."""

    nats_url: str = field(default="", metadata=flag(
        "NATS server URL, e.g. nats://127.0.0.1:4222", group=NATS, required=True))
    namespace: str = field(default="ringserve", metadata=flag(
        "subject prefix isolating this deployment", group=NATS))
    log_level: str = field(default_factory=lambda: os.environ.get("RINGSERVE_LOG_LEVEL", "INFO"), metadata=flag(
        "DEBUG, INFO, WARNING or ERROR (default: $RINGSERVE_LOG_LEVEL, else INFO)", group=PROCESS))
    drain_timeout: float = field(default=DEFAULT_DRAIN_SECONDS, metadata=flag(
        "on SIGTERM/SIGINT, finish the requests held for at most this long, then stop (a second signal stops at "
        "once)", group=PROCESS, metavar="SECONDS"))


def add_bus_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every actor process takes."""
    for declared in (BusFlags, NatsAuthFlags, TracingFlags):
        flag_fields.add_arguments(declared, parser)


def add_nats_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """How to authenticate to NATS (none given: unauthenticated). Secrets come from files or the environment."""
    flag_fields.add_arguments(NatsAuthFlags, parser)


def credentials_from_args(args: argparse.Namespace) -> NatsCredentials | None:
    """The NATS credentials the auth flags describe (raises CredentialsError for unusable ones)."""
    return flag_fields.from_args(NatsAuthFlags, args).credentials()
