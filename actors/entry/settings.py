"""The entry's settings: its command-line flags (shared with `ringserve serve`) and the API key from the env.

The API key is deliberately not a flag (command lines are visible to every local user in `ps`): the launcher
and the entry read `RINGSERVE_API_KEY` from their environment.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

API_KEY_ENV = "RINGSERVE_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_STALL_TIMEOUT = 300.0


@dataclass
class EntrySettings:
    """What the HTTP entry is configured with."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model: str = ""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    cors_allow_origins: list[str] = field(default_factory=list)
    api_key: str | None = field(default=None, repr=False)  # never printed

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> "EntrySettings":
        """Settings from parsed flags and `RINGSERVE_API_KEY` (empty or unset: no auth)."""
        env = os.environ if environ is None else environ
        settings = cls(host=args.host, port=args.port, served_model=args.served_model_name,
                       max_request_bytes=args.max_request_bytes, max_queued_requests=args.max_queued_requests,
                       stall_timeout=args.stall_timeout, cors_allow_origins=parse_origins(args.cors_allow_origins),
                       api_key=env.get(API_KEY_ENV) or None)
        settings.validate()
        return settings

    def validate(self) -> None:
        """ValueError for a setting out of range."""
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be at least 1024")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be at least 1")
        if not self.stall_timeout > 0:
            raise ValueError("--stall-timeout must be > 0")


def parse_origins(value: str | None) -> list[str]:
    """`--cors-allow-origins a,b` as a list (empty: CORS off)."""
    return [origin.strip() for origin in (value or "").split(",") if origin.strip()]


def add_entry_arguments(parser: argparse.ArgumentParser) -> None:
    """The entry's hardening flags, on the entry's own parser and on `ringserve serve`."""
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest HTTP request body; larger ones get 413")
    parser.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="live requests the entry admits (each choice of n counts); beyond, 503 with "
                             "Retry-After")
    parser.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT,
                        help="seconds a request may go without output (queued or running) before it ends with "
                             "a 503 error and is aborted")
    parser.add_argument("--cors-allow-origins", default="",
                        help="comma-separated origins allowed by CORS (default: CORS off)")


def entry_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `add_entry_arguments` as parsed, for the entry's command line (never the API key)."""
    argv = ["--max-request-bytes", str(args.max_request_bytes),
            "--max-queued-requests", str(args.max_queued_requests),
            "--stall-timeout", repr(float(args.stall_timeout))]
    if args.cors_allow_origins:
        argv += ["--cors-allow-origins", args.cors_allow_origins]
    return argv
