"""`ringserve submit`: one request to a running ring over NATS, from the shell (no HTTP).

    ringserve submit --creds client-c.json --text "Say hello" --max-new-tokens 32 --temperature 0 --stream

The prompt is `--text`, `--messages JSON` (chat turns; the chat template is applied) or `--input-ids JSON`.
Every native sampling parameter is a flag (`--temperature`, `--top-p`, `--stop` (repeatable), `--json-schema`,
...: bus/params.py declares them; `--max-new-tokens` defaults to 128, as in /generate), and `--sampling JSON`
gives any of them at once. With a client's credentials file (`ringserve serve --nats-client c` logs its path)
the request goes on that client's subjects, and the file's notes give the URL and namespace. Output: the text
at the end, or as it arrives with `--stream`, or each `RequestOutput` message as a JSON line with `--json`.
An error answer is printed as the HTTP API's error body on stderr (exit code 1); no NATS or no ring is
exit code 2.
"""

from __future__ import annotations

import argparse
import base64
import asyncio
import contextlib
import json
import logging
import sys
from dataclasses import asdict, dataclass, field, make_dataclass
from typing import Any

from ringserve.actors.common import flag_fields
from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import DefaultOnceFormatter
from ringserve.bus.codec import DecodeError, from_wire, to_wire
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import ChatMessage, GenerateRequest
from ringserve.bus.param_spec import LOGIT_BIAS, STOP_STRINGS, TOKEN_IDS
from ringserve.bus.params import SPECS, default_of
from ringserve.bus.ring_session import RingSession
from ringserve.bus.subjects import new_rid

DEFAULT_MAX_NEW_TOKENS = 128


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc


def _json_text(value: Any) -> str:
    """A JSON flag's value as its flag takes it (what `_json_arg` reads back)."""
    return json.dumps(value, ensure_ascii=False)


RING = "ring"
PROMPT = "prompt (one of)"
SAMPLING = "sampling (native names, bus/params.py; unset ones keep their defaults)"
OUTPUT = "output"
PROMPT_FIELDS = ("text", "messages", "input_ids")


@dataclass
class SubmitFlags:
    """The flags of `ringserve submit` but the sampling parameters' (SamplingFlags): where the ring is, the
    prompt (one of `--text`, `--messages`, `--input-ids`, required), `--sampling` and the output."""

    nats_url: str | None = field(default=None, metadata=flag(
        "NATS URL (default: the credentials file's, else nats://127.0.0.1:4222)", group=RING))
    namespace: str | None = field(default=None, metadata=flag(
        "the ring's namespace (default: the credentials file's, else ringserve)", group=RING))
    creds: str | None = field(default=None, metadata=flag(
        "NATS credentials: a client's file (`--nats-client NAME` logs its path) or a NATS .creds", group=RING,
        metavar="FILE"))
    client: str | None = field(default=None, metadata=flag(
        "submit as NATS client NAME (default: the credentials file's client, else unscoped)", group=RING,
        metavar="NAME"))
    text: str | None = field(default=None, metadata=flag("the prompt text", group=PROMPT))
    messages: Any = field(default=None, metadata=flag(
        'chat turns, e.g. \'[{"role": "user", "content": "Hi"}]\' (the chat template is applied)', group=PROMPT,
        type=_json_arg, metavar="JSON", to_text=_json_text))
    input_ids: Any = field(default=None, metadata=flag(
        "the prompt's token ids, e.g. [1, 2, 3]", group=PROMPT, type=_json_arg, metavar="JSON", to_text=_json_text))
    sampling: Any = field(default=None, metadata=flag(
        "more sampling parameters as a JSON object (the flags above win)", group=SAMPLING, type=_json_arg,
        metavar="JSON", to_text=_json_text))
    stream: bool = field(default=False, metadata=flag("print the text as it arrives", group=OUTPUT))
    json: bool = field(default=False, metadata=flag("print every RequestOutput message as a JSON line", group=OUTPUT))
    rid: str | None = field(default=None, metadata=flag("the request id (default: a fresh one)", group=OUTPUT))
    timeout: float = field(default=600.0, metadata=flag("seconds to wait for the answer", group=OUTPUT))


# A sampling parameter on by default is turned off by `--no-NAME`: its field is `no_NAME` (on: the parameter off).
TURNED_OFF_BY = {"no_" + name: name for name, spec in SPECS.items() if spec.kind == "boolean" and default_of(name)}


def _sampling_field(name: str) -> tuple[str, Any, Any]:
    """Sampling parameter `name`'s flag, as make_dataclass takes a field: unset (None) unless given."""
    spec = SPECS[name]
    if name == "max_new_tokens":
        return name, int | None, field(default=None, metadata=flag(
            f"{spec.doc} (default {DEFAULT_MAX_NEW_TOKENS})", group=SAMPLING, type=int))
    if spec.shape == STOP_STRINGS:
        return name, list[str] | None, field(default=None, metadata=flag(
            f"{spec.doc} (repeatable)", group=SAMPLING, action="append", metavar="TEXT"))
    if spec.shape in (TOKEN_IDS, LOGIT_BIAS):
        return name, Any, field(default=None, metadata=flag(
            spec.doc, group=SAMPLING, type=_json_arg, metavar="JSON", to_text=_json_text))
    if spec.kind == "boolean" and default_of(name):  # on by default: the flag turns it off
        return "no_" + name, bool, field(default=False, metadata=flag(f"turn off: {spec.doc}", group=SAMPLING))
    if spec.kind == "boolean":
        return name, bool | None, field(default=None, metadata=flag(
            spec.doc, group=SAMPLING, action="store_const", const=True))
    kind = {"integer": int, "number": float}.get(spec.kind, str)
    return name, kind | None, field(default=None, metadata=flag(spec.doc, group=SAMPLING, type=kind))


SamplingFlags = make_dataclass("SamplingFlags", [_sampling_field(name) for name in SPECS])
SamplingFlags.__doc__ = """`ringserve submit`'s flag per native sampling parameter (bus/params.py), None unless given
(`no_NAME` for one on by default: True turns it off)."""


def given_sampling(flags: Any) -> dict[str, Any]:
    """The sampling parameters SamplingFlags `flags` give, by their native names."""
    given: dict[str, Any] = {}
    for f in flag_fields.flag_fields(SamplingFlags):
        value = getattr(flags, f.name)
        if f.name in TURNED_OFF_BY:
            if value:
                given[TURNED_OFF_BY[f.name]] = False
        elif value is not None:
            given[f.name] = value
    return given


def add_submit_arguments(cmd: argparse.ArgumentParser) -> None:
    """The flags of `ringserve submit`, grouped: ring, prompt (one of), sampling, output."""
    flag_fields.add_arguments(SubmitFlags, cmd, names=[f.name for f in flag_fields.flag_fields(SubmitFlags)
                                                       if f.metadata["group"] == RING])
    flag_fields.add_exclusive_arguments(SubmitFlags, cmd, PROMPT_FIELDS, group=PROMPT, required=True)
    flag_fields.add_arguments(SamplingFlags, cmd)
    flag_fields.add_arguments(SubmitFlags, cmd, names=[f.name for f in flag_fields.flag_fields(SubmitFlags)
                                                       if f.metadata["group"] in (SAMPLING, OUTPUT)])


def add_submit_command(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the `submit` subcommand."""
    cmd = commands.add_parser("submit", help="send one request to a running ring over NATS and print the answer",
                              description=__doc__.split("\n\n")[0], formatter_class=DefaultOnceFormatter)
    add_submit_arguments(cmd)


def build_request(args: argparse.Namespace) -> GenerateRequest:
    """The GenerateRequest the flags describe; ApiError for a prompt or sampling JSON of the wrong shape."""
    sampling = dict(args.sampling or {})
    if not isinstance(sampling, dict):
        raise ApiError("--sampling must be a JSON object", param="sampling")
    sampling.update(given_sampling(flag_fields.from_args(SamplingFlags, args)))
    sampling.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    try:
        messages = from_wire(list[ChatMessage], args.messages, "messages") if args.messages is not None else None
        input_ids = from_wire(list[int], args.input_ids, "input_ids") if args.input_ids is not None else None
    except DecodeError as exc:
        raise ApiError(f"--{str(exc).split(':', 1)[0].split('[')[0].replace('_', '-')}: {exc}",
                       param="messages" if args.messages is not None else "input_ids") from exc
    return GenerateRequest(rid=args.rid or new_rid(), text=args.text, messages=messages, input_ids=input_ids,
                           sampling=sampling, stream=args.stream or args.json)


async def _submit(args: argparse.Namespace) -> int:
    request = build_request(args)
    client = RingSession(args.nats_url, args.namespace, args.creds, client=args.client, name="ringserve-submit")
    try:
        await client.connect()
    except ConnectionError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
    try:
        return await asyncio.wait_for(_print_outputs(client, request, args), args.timeout)
    except asyncio.TimeoutError:
        print(f"ringserve: no answer within {args.timeout:g}s (the request was aborted)", file=sys.stderr)
        return 1
    finally:
        await client.close()


def _json_bytes(value: Any) -> str:
    """JSON for the bytes of an output (an embedding's float32 vector): base64, as OpenAI's encoding_format."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


async def _print_outputs(client: RingSession, request: GenerateRequest, args: argparse.Namespace) -> int:
    text: list[str] = []
    streamed = args.stream and not args.json
    try:
        async with contextlib.aclosing(client.outputs(request)) as outputs:
            async for out in outputs:
                if args.json:
                    print(json.dumps({"type": "RequestOutput", "body": to_wire(out)}, ensure_ascii=False,
                                     default=_json_bytes), flush=True)
                elif args.stream:
                    print(out.text, end="", flush=True)
                text.append(out.text)
                if out.error is not None:
                    _end_line(streamed, text)
                    if not args.json:
                        print(json.dumps(out.error.body(), ensure_ascii=False), file=sys.stderr)
                    return 1
                if out.finish is not None and not args.json:
                    print("\n" if streamed else "".join(text), end="" if streamed else "\n", flush=True)
                    streamed = False  # the line is ended
                    print(f"[finish: {json.dumps(asdict(out.finish))}, prompt_tokens {out.prompt_tokens}, "
                          f"completion_tokens {out.completion_tokens}]", file=sys.stderr)
    except BaseException:  # a timeout or Ctrl-C while streaming: what was printed still ends its line
        _end_line(streamed, text)
        raise
    return 0


def _end_line(streamed: bool, text: list[str]) -> None:
    """End the streamed text's line on stdout (once), so what follows starts on a line of its own."""
    if streamed and "".join(text):
        print(flush=True)
        text.clear()


def submit_command(args: argparse.Namespace) -> int:
    """`ringserve submit`: the exit code (0 answered, 1 an error answer or timeout, 2 no NATS or no ring)."""
    logging.getLogger().addHandler(logging.NullHandler())  # the answer or the exit code says what went wrong
    try:
        return asyncio.run(_submit(args))
    except ApiError as exc:  # the request could not be built, or the ring is unavailable (503)
        print(json.dumps(exc.body(), ensure_ascii=False), file=sys.stderr)
        return 2 if exc.code == 503 else 1
    except KeyboardInterrupt:
        return 130
