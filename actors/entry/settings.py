"""The entry's settings: its command-line flags (shared with `ringserve serve`) and the API keys from the env.

The API keys are deliberately not flags (command lines are visible to every local user in `ps`): the launcher
and the entry read `RINGSERVE_API_KEY` and `RINGSERVE_ADMIN_API_KEY` from their environment.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from ringserve.actors.common.cli_forms import add_refused
from ringserve.actors.entry.tool_parsers import AUTO, DEFAULT_PARSER, PARSERS
from ringserve.actors.entry.image_input import (
    DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGES, DEFAULT_REMOTE_TIMEOUT, ImageLimits,
)
from ringserve.bus import image_store
from ringserve.bus.response_store import DEFAULT_MAX_BYTES, DEFAULT_TTL_SECONDS

API_KEY_ENV = "RINGSERVE_API_KEY"
ADMIN_API_KEY_ENV = "RINGSERVE_ADMIN_API_KEY"  # guards the operator routes (flush, pause, abort) on its own
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_BODY_READ_TIMEOUT = 30.0
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_STALL_TIMEOUT = 300.0
# seconds of heartbeat silence before a running actor counts as lost (its streams end): beats come from a thread
# of their own, so only a stalled process is silent this long; a process that ended is known at once
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


@dataclass
class EntrySettings:
    """What the HTTP entry is configured with."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model: str = ""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    cors_allow_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)  # empty: derived from `host`, see resolved_allowed_hosts
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT
    tool_call_parser: str = DEFAULT_PARSER  # reads tool calls out of chat output (tool_choice auto)
    responses_ttl: float = DEFAULT_TTL_SECONDS  # stored Responses-API responses (bus/response_store.py)
    responses_max_bytes: int = DEFAULT_MAX_BYTES
    images: ImageLimits = field(default_factory=ImageLimits)  # image inputs (image_input.py)
    image_ttl: float = image_store.DEFAULT_TTL_SECONDS  # the image bucket (bus/image_store.py)
    image_store_max_bytes: int = image_store.DEFAULT_MAX_BYTES
    api_key: str | None = field(default=None, repr=False)  # never printed
    admin_api_key: str | None = field(default=None, repr=False)

    def resolved_allowed_hosts(self) -> frozenset[str] | None:
        """The Host names requests may carry (None: any). By default, listening on a loopback address allows the
        loopback names only (a browser page cannot rebind its name to reach the API); on any other address,
        any host."""
        if self.allowed_hosts:
            return None if "*" in self.allowed_hosts else frozenset(h.lower() for h in self.allowed_hosts)
        host = self.host.strip("[]").lower()
        if host in LOOPBACK_HOSTS or host.startswith("127."):
            return frozenset({*LOOPBACK_HOSTS, host})
        return None

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> "EntrySettings":
        """Settings from parsed flags and `RINGSERVE_API_KEY` (empty or unset: no auth)."""
        env = os.environ if environ is None else environ
        settings = cls(host=args.host, port=args.port, served_model=args.served_model_name,
                       max_request_bytes=args.max_request_bytes, max_queued_requests=args.max_queued_requests,
                       stall_timeout=args.stall_timeout, heartbeat_timeout=args.heartbeat_timeout,
                       cors_allow_origins=parse_origins(args.cors_allow_origins),
                       allowed_hosts=parse_origins(args.allowed_hosts), body_read_timeout=args.body_read_timeout,
                       tool_call_parser=args.tool_call_parser, responses_ttl=args.responses_ttl,
                       responses_max_bytes=args.responses_max_bytes,
                       images=ImageLimits(args.max_image_bytes, args.max_images_per_request, args.allow_remote_images,
                                          args.remote_image_timeout, args.allowed_local_media_path or None),
                       image_ttl=args.image_ttl, image_store_max_bytes=args.image_store_max_bytes,
                       api_key=env.get(API_KEY_ENV) or None, admin_api_key=env.get(ADMIN_API_KEY_ENV) or None)
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
        if not self.heartbeat_timeout >= 1.0:
            raise ValueError("--heartbeat-timeout must be at least 1 (seconds; actors beat every 0.5 s)")
        if not self.body_read_timeout > 0:
            raise ValueError("--body-read-timeout must be > 0")
        if not self.responses_ttl > 0:
            raise ValueError("--responses-ttl must be > 0")
        if self.responses_max_bytes < 1024 * 1024:
            raise ValueError("--responses-max-bytes must be at least 1048576")
        if self.images.max_bytes < 1024 or self.images.max_images < 0 or not self.images.remote_timeout > 0:
            raise ValueError("--max-image-bytes must be at least 1024, --max-images-per-request at least 0 and "
                             "--remote-image-timeout > 0")
        if self.images.local_dir is not None and not os.path.isdir(self.images.local_dir):
            raise ValueError(f"--allowed-local-media-path {self.images.local_dir!r} is not a directory")
        if not self.image_ttl > 0 or self.image_store_max_bytes < 1024 * 1024:
            raise ValueError("--image-ttl must be > 0 and --image-store-max-bytes at least 1048576")
        if self.tool_call_parser == AUTO:  # the launcher resolves auto; an entry started on its own reads Hermes
            self.tool_call_parser = DEFAULT_PARSER
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}")


def parse_origins(value: str | None) -> list[str]:
    """A comma-separated flag (`--cors-allow-origins a,b`, `--allowed-hosts`) as a list; vLLM's JSON list form
    (`--allowed-origins '["https://a"]'`) too. ValueError for a JSON list that is not of strings."""
    text = (value or "").strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{text!r} is neither a comma-separated list nor a JSON list ({exc})") from None
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"{text!r}: a JSON list of origins or hosts must hold strings")
        return [item.strip() for item in items if item.strip()]
    return [origin.strip() for origin in text.split(",") if origin.strip()]


def _list_flag(value: str) -> str:
    """A list flag's value, checked at parse time (argparse's error names the flag); kept as given."""
    try:
        parse_origins(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


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
    parser.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT, metavar="SECONDS",
                        help="seconds without a heartbeat before a running scheduler or detokenizer counts as lost "
                             "and the streams it holds end with a 503 (heartbeats come from a thread of their own, "
                             "so a busy actor still beats; an actor whose process ended is known at once)")
    parser.add_argument("--cors-allow-origins", "--allowed-origins", default="", type=_list_flag,
                        help="origins allowed by CORS, comma-separated or as vLLM's JSON list (default: CORS off)")
    add_refused(parser, "--api-key", f"the API key is read from ${API_KEY_ENV} (and the operator routes' from "
                                     f"${ADMIN_API_KEY_ENV}), never from a flag, which every local user can read in "
                                     f"ps: export {API_KEY_ENV}=... instead")
    parser.add_argument("--allowed-hosts", default="", type=_list_flag,
                        help="comma-separated Host names requests may carry, or * for any (default: the loopback "
                             "names when --host is a loopback address, else any); others get 421")
    parser.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT,
                        help="seconds a client may take to send its request body; slower uploads get 408")
    parser.add_argument("--tool-call-parser", default=AUTO, choices=[AUTO, *sorted(PARSERS)],
                        help="how chat output is read for tool calls with tool_choice auto: hermes "
                             "(<tool_call>{...}</tool_call>, Qwen's too), llama3_json (bare JSON objects), mistral "
                             "([TOOL_CALLS]...), pythonic ([f(x=1)]), qwen3_coder (Qwen3-Coder's and Qwen3.5's "
                             "<function=...> XML), glm45 (GLM-4.5's <arg_key>/<arg_value>), deepseek_v3 (DeepSeek "
                             "V3's, R1's and V3.1's), kimi_k2 (Kimi-K2's sections), openai (gpt-oss's harmony "
                             "messages), or auto: the one the model's chat template asks for (hermes when it says "
                             "nothing)")
    parser.add_argument("--responses-ttl", type=float, default=DEFAULT_TTL_SECONDS, metavar="SECONDS",
                        help="how long a stored /v1/responses response (and the conversation it continues) is kept "
                             "in the bus's JetStream bucket {namespace}-responses")
    parser.add_argument("--responses-max-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="BYTES",
                        help="size cap of the stored responses' bucket; when it is full the oldest go first")
    parser.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES, metavar="BYTES",
                        help="largest image file a request may bring (chat image_url, /generate image_data); larger "
                             "ones get a 400 naming the image")
    parser.add_argument("--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES, metavar="N",
                        help="images one prompt may hold; more get a 400")
    parser.add_argument("--allow-remote-images", action="store_true",
                        help="fetch http(s) image URLs (default: refused with a 400; data URLs always work)")
    parser.add_argument("--remote-image-timeout", type=float, default=DEFAULT_REMOTE_TIMEOUT, metavar="SECONDS",
                        help="with --allow-remote-images: seconds to fetch one image URL, else a 400")
    parser.add_argument("--allowed-local-media-path", default="", metavar="DIR",
                        help="read file:// image URLs under DIR (default: file URLs are refused with a 400)")
    parser.add_argument("--image-ttl", type=float, default=image_store.DEFAULT_TTL_SECONDS, metavar="SECONDS",
                        help="how long images and their processed tensors stay in the bus's object store bucket "
                             "{namespace}-images")
    parser.add_argument("--image-store-max-bytes", type=int, default=image_store.DEFAULT_MAX_BYTES,
                        metavar="BYTES", help="size cap of the image bucket; when it is full the oldest go first")


def entry_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `add_entry_arguments` as parsed, for the entry's command line (never the API key)."""
    argv = ["--max-request-bytes", str(args.max_request_bytes),
            "--max-queued-requests", str(args.max_queued_requests),
            "--stall-timeout", repr(float(args.stall_timeout)),
            "--heartbeat-timeout", repr(float(args.heartbeat_timeout)),
            "--body-read-timeout", repr(float(args.body_read_timeout)),
            "--tool-call-parser", args.tool_call_parser,
            "--responses-ttl", repr(float(args.responses_ttl)), "--responses-max-bytes", str(args.responses_max_bytes),
            "--max-image-bytes", str(args.max_image_bytes), "--max-images-per-request", str(args.max_images_per_request),
            "--remote-image-timeout", repr(float(args.remote_image_timeout)), "--image-ttl", repr(float(args.image_ttl)),
            "--image-store-max-bytes", str(args.image_store_max_bytes)]
    if args.allow_remote_images:
        argv.append("--allow-remote-images")
    if args.allowed_local_media_path:
        argv += ["--allowed-local-media-path", os.path.abspath(args.allowed_local_media_path)]
    if args.cors_allow_origins:
        argv += ["--cors-allow-origins", args.cors_allow_origins]
    if args.allowed_hosts:
        argv += ["--allowed-hosts", args.allowed_hosts]
    return argv
