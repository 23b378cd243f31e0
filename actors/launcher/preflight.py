"""What `ringserve serve` checks before it loads anything: that its HTTP port is free and that `--nats-url`
answers. A clash found after a model load is a traceback minutes in; found here it is one line, at once."""

from __future__ import annotations

import argparse
import socket
from urllib.parse import urlsplit

from ringserve.bus.embedded_server import check_port_free

NATS_DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "ws": 80, "wss": 443}
CONNECT_TIMEOUT_S = 3.0


class EndpointError(ValueError):
    """A port in use or a NATS server that does not answer; the message names it and what to do."""


def check_http_port(host: str, port: int) -> None:
    """EndpointError unless the entry actor could listen on `host:port`."""
    try:
        check_port_free(host, port, "pass --port")
    except OSError as exc:
        raise EndpointError(str(exc)) from None


def check_nats_reachable(url: str) -> None:
    """EndpointError unless a TCP connection to one of the servers in `url` (comma-separated, without
    credentials) opens within CONNECT_TIMEOUT_S."""
    errors = []
    for server in url.split(","):
        parts = urlsplit(server.strip() if "://" in server else f"nats://{server.strip()}")
        try:
            port = parts.port or NATS_DEFAULT_PORTS.get(parts.scheme, 4222)
            with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=CONNECT_TIMEOUT_S):
                return
        except (OSError, ValueError) as exc:
            errors.append(f"{parts.hostname}:{parts.port or ''}: {getattr(exc, 'strerror', None) or exc}")
    raise EndpointError(f"NATS at {url} is not reachable ({'; '.join(errors)}): start it, fix --nats-url, or leave "
                        "--nats-url out to run an embedded nats-server")


def check_endpoints(args: argparse.Namespace, nats_url: str, external_nats: bool, http: bool) -> None:
    """The checks `Ring` makes before anything loads: the HTTP port (with `http`) and an external NATS."""
    if http:
        check_http_port(args.host, args.port)
    if external_nats:
        check_nats_reachable(nats_url)
