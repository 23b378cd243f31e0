"""The entry's settings: its command-line flags (`EntryFlags`, shared with `ringserve serve`) and the API keys from
the env.

The API keys are deliberately not flags (command lines are visible to every local user in `ps`): the launcher
and the entry read `RINGSERVE_API_KEY` and `RINGSERVE_ADMIN_API_KEY` from their environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

from ringserve.actors.common import flag_fields
from ringserve.actors.common.cli_forms import add_refused
from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import CHAT, HTTP, IMAGES
from ringserve.actors.entry.tool_parsers import AUTO, DEFAULT_PARSER, PARSERS
from ringserve.actors.entry.image_input import (
    DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGES, DEFAULT_REMOTE_TIMEOUT, ImageLimits,
)
from ringserve.bus import image_store
from ringserve.bus.response_store import DEFAULT_MAX_BYTES, DEFAULT_TTL_SECONDS

API_KEY_ENV = "RINGSERVE_API_KEY"
ADMIN_API_KEY_ENV = "RINGSERVE_ADMIN_API_KEY"  # guards the operator routes (flush, pause, abort) on its own
API_KEY_REFUSAL = (f"the API key is read from ${API_KEY_ENV} (and the operator routes' from ${ADMIN_API_KEY_ENV}), "
                   f"never from a flag, which every local user can read in ps: export {API_KEY_ENV}=... instead")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_BODY_READ_TIMEOUT = 30.0
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_STALL_TIMEOUT = 300.0
# seconds of heartbeat silence before a running actor counts as lost (its streams end): beats come from a thread
# of their own, so only a stalled process is silent this long; a process that ended is known at once
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


def _list_flag(value: str) -> str:
    """A list flag's value, checked at parse time (argparse's error names the flag); kept as given."""
    try:
        parse_origins(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


@dataclass
class EntryFlags:
    """The entry's flags as given (also `ringserve serve`'s), declared once (actors/common/flag_fields.py)."""

    host: str = field(default="127.0.0.1", metadata=flag("HTTP address to listen on", group=HTTP))
    port: int = field(default=8000, metadata=flag("HTTP port", group=HTTP))
    max_request_bytes: int = field(default=DEFAULT_MAX_REQUEST_BYTES, metadata=flag(
        "largest HTTP request body; larger ones get 413", group=HTTP))
    max_queued_requests: int = field(default=DEFAULT_MAX_QUEUED_REQUESTS, metadata=flag(
        "live requests the entry admits (each choice of n counts); beyond, 503 with Retry-After", group=HTTP))
    stall_timeout: float = field(default=DEFAULT_STALL_TIMEOUT, metadata=flag(
        "seconds a request may go without output (queued or running) before it ends with a 503 error and is "
        "aborted", group=HTTP))
    heartbeat_timeout: float = field(default=DEFAULT_HEARTBEAT_TIMEOUT, metadata=flag(
        "seconds without a heartbeat before a running scheduler or detokenizer counts as lost and the streams it "
        "holds end with a 503 (heartbeats come from a thread of their own, so a busy actor still beats; an actor "
        "whose process ended is known at once)", group=HTTP, metavar="SECONDS"))
    cors_allow_origins: str = field(default="", metadata=flag(
        "origins allowed by CORS, comma-separated or as vLLM's JSON list (default: CORS off)", group=HTTP,
        aliases=("--allowed-origins",), type=_list_flag))
    allowed_hosts: str = field(default="", metadata=flag(
        "comma-separated Host names requests may carry, or * for any (default: the loopback names when --host is a "
        "loopback address, else any); others get 421", group=HTTP, type=_list_flag))
    body_read_timeout: float = field(default=DEFAULT_BODY_READ_TIMEOUT, metadata=flag(
        "seconds a client may take to send its request body; slower uploads get 408", group=HTTP))
    tool_call_parser: str = field(default=AUTO, metadata=flag(
        "how chat output is read for tool calls with tool_choice auto: hermes (<tool_call>{...}</tool_call>, "
        "Qwen's too), llama3_json (bare JSON objects), mistral ([TOOL_CALLS]...), pythonic ([f(x=1)]), qwen3_coder "
        "(Qwen3-Coder's and Qwen3.5's <function=...> XML), glm45 (GLM-4.5's <arg_key>/<arg_value>), deepseek_v3 "
        "(DeepSeek V3's, R1's and V3.1's), kimi_k2 (Kimi-K2's sections), openai (gpt-oss's harmony messages), or "
        "auto: the one the model's chat template asks for (hermes when it says nothing)",
        group=CHAT, choices=[AUTO, *sorted(PARSERS)]))
    responses_ttl: float = field(default=DEFAULT_TTL_SECONDS, metadata=flag(
        "how long a stored /v1/responses response (and the conversation it continues) is kept in the bus's "
        "JetStream bucket {namespace}-responses", group=HTTP, metavar="SECONDS"))
    responses_max_bytes: int = field(default=DEFAULT_MAX_BYTES, metadata=flag(
        "size cap of the stored responses' bucket; when it is full the oldest go first", group=HTTP, metavar="BYTES"))
    max_image_bytes: int = field(default=DEFAULT_MAX_IMAGE_BYTES, metadata=flag(
        "largest image file a request may bring (chat image_url, /generate image_data); larger ones get a 400 "
        "naming the image", group=IMAGES, metavar="BYTES"))
    max_images_per_request: int = field(default=DEFAULT_MAX_IMAGES, metadata=flag(
        "images one prompt may hold; more get a 400", group=IMAGES, metavar="N"))
    allow_remote_images: bool = field(default=False, metadata=flag(
        "fetch http(s) image URLs (default: refused with a 400; data URLs always work)", group=IMAGES))
    remote_image_timeout: float = field(default=DEFAULT_REMOTE_TIMEOUT, metadata=flag(
        "with --allow-remote-images: seconds to fetch one image URL, else a 400", group=IMAGES, metavar="SECONDS"))
    allowed_local_media_path: str = field(default="", metadata=flag(
        "read file:// image URLs under DIR (default: file URLs are refused with a 400)", group=IMAGES, metavar="DIR"))
    image_ttl: float = field(default=image_store.DEFAULT_TTL_SECONDS, metadata=flag(
        "how long images and their processed tensors stay in the bus's object store bucket {namespace}-images",
        group=IMAGES, metavar="SECONDS"))
    image_store_max_bytes: int = field(default=image_store.DEFAULT_MAX_BYTES, metadata=flag(
        "size cap of the image bucket; when it is full the oldest go first", group=IMAGES, metavar="BYTES"))

    def __post_init__(self) -> None:
        if self.allowed_local_media_path:  # the entry may run in another directory than the launcher
            self.allowed_local_media_path = os.path.abspath(self.allowed_local_media_path)

    def image_limits(self) -> ImageLimits:
        """What the image flags allow."""
        return ImageLimits(self.max_image_bytes, self.max_images_per_request, self.allow_remote_images,
                           self.remote_image_timeout, self.allowed_local_media_path or None)


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
        return cls.from_flags(flag_fields.from_args(EntryFlags, args), args.served_model_name, environ)

    @classmethod
    def from_flags(cls, flags: EntryFlags, served_model: str,
                   environ: dict[str, str] | None = None) -> "EntrySettings":
        """Settings from the entry's flags (the fields of both keep one name) and the API keys in `environ`."""
        env = os.environ if environ is None else environ
        names = {f.name for f in dataclasses.fields(cls)}
        same = {name: value for name, value in vars(flags).items() if name in names}
        settings = cls(**{**same, "cors_allow_origins": parse_origins(flags.cors_allow_origins),
                          "allowed_hosts": parse_origins(flags.allowed_hosts)},
                       served_model=served_model, images=flags.image_limits(),
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


def add_entry_arguments(parser: argparse.ArgumentParser) -> None:
    """The entry's flags, on the entry's own parser and on `ringserve serve`; `--api-key` is refused."""
    flag_fields.add_arguments(EntryFlags, parser)
    add_refused(flag_fields.argument_group(parser, HTTP), "--api-key", API_KEY_REFUSAL)


def entry_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `add_entry_arguments` as parsed, for the entry's command line (never the API key)."""
    return flag_fields.to_argv(flag_fields.from_args(EntryFlags, args))
