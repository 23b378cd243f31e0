"""Every flag is declared once, as a dataclass field (actors/common/flag_fields.py): `ringserve serve --help` files
each flag under one group of actors/common/help_format.py, every command's help says each default at most once,
every actor's settings survive the trip through the argv the launcher writes and the parser that reads it, and so
do the flags of `ringserve trace`, `nats-config`, `submit` and `worker` through their own parsers."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from ringserve.actors.common import flag_fields
from ringserve.actors.common.actor_flags import BusFlags, NatsAuthFlags
from ringserve.actors.common.help_format import GROUP_ORDER
from ringserve.actors.common.process_flags import (
    DetokenizerProcessFlags, EntryProcessFlags, SchedulerProcessFlags, TokenizerProcessFlags,
)
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.entry.settings import EntryFlags
from ringserve.actors.launcher.cli import build_parser
from ringserve.actors.launcher.nats_config_cmd import NatsConfigFlags
from ringserve.actors.launcher.ring import actor_specs
from ringserve.actors.launcher.serve_flags import ServeFlags, serve_args
from ringserve.actors.launcher.submit_cmd import SamplingFlags, SubmitFlags, build_request, given_sampling
from ringserve.actors.launcher.trace_cmd import TraceFlags, read_hint, trace_argv
from ringserve.actors.launcher.worker_cmd import EntryModelFlags, WorkerFlags, role_argv
from ringserve.actors.scheduler.admission import AdmissionFlags
from ringserve.actors.scheduler.tp_follower import TensorParallelFlags
from ringserve.actors.tokenizer.chat_options import ChatFlags
from ringserve.actors.trace_exporter.__main__ import SpanStreamFlags
from ringserve.observability.tracing_config import TracingFlags

DECLARATIONS = (ServeFlags, AdmissionFlags, TensorParallelFlags, ChatFlags, EntryFlags, NatsAuthFlags, TracingFlags,
                BusFlags, SchedulerProcessFlags, TokenizerProcessFlags, DetokenizerProcessFlags, EntryProcessFlags,
                SpanStreamFlags, TraceFlags, NatsConfigFlags, SubmitFlags, SamplingFlags, WorkerFlags, EntryModelFlags)
SUBCOMMANDS = ("serve", "trace", "nats-config", "submit", "worker")
TWO_DEFAULTS = re.compile(r"\(default\b|\bdefault:", re.IGNORECASE)


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `ringserve NAME`."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("no subcommands")


def serve_parser() -> argparse.ArgumentParser:
    return subcommand_parser("serve")


def help_sections(text: str) -> dict[str, list[str]]:
    """`--help` text as group title -> the option strings listed under it."""
    sections: dict[str, list[str]] = {}
    title = ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = []
        elif title and line.startswith("  -"):
            sections[title] += re.findall(r"(?<![\w-])(--?[\w][\w-]*)", line.split("  ", 2)[1])
    return sections


def option_blocks(text: str) -> list[str]:
    """Each flag's lines of a `--help` text, joined."""
    body = text.split("\n\n", 1)[1]
    return [" ".join(block.split()) for block in re.split(r"\n(?=  -)", body) if block.startswith("  -")]


def test_serve_help_files_every_flag_under_one_group_in_order() -> None:
    parser = serve_parser()
    sections = help_sections(parser.format_help())
    assert list(sections) == ["options", *GROUP_ORDER]
    assert sections["options"] == ["-h", "--help"]
    listed = [option for options in sections.values() for option in options]
    flags = [option for action in parser._actions for option in action.option_strings]
    assert sorted(listed) == sorted(flags) and len(set(listed)) == len(listed)


@pytest.mark.parametrize("role", [*SUBCOMMANDS, "scheduler", "tokenizer", "detokenizer", "entry", "trace_exporter"])
def test_help_says_each_default_once(role: str) -> None:
    if role in SUBCOMMANDS:
        text = subcommand_parser(role).format_help()
    else:
        text = importlib.import_module(f"ringserve.actors.{role}.__main__").build_parser().format_help()
    twice = [block for block in option_blocks(text) if len(TWO_DEFAULTS.findall(block)) > 1]
    assert not twice, twice


def other_value(f: dataclasses.Field[Any]) -> Any:
    """A value of field `f` that is not its default and that its flag takes."""
    default = flag_fields.field_default(f)
    choices = f.metadata.get("choices")
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default + 2
    if isinstance(default, list) or f.metadata.get("action") == "append":
        return ["a", "b"]
    if f.metadata.get("action") == "store_const":
        return f.metadata["const"]
    if f.metadata.get("type") in (int, float):
        return f.metadata["type"](3)
    return "/tmp" if "path" in f.name else "x"


@pytest.mark.parametrize("declared", DECLARATIONS, ids=lambda cls: cls.__name__)
def test_settings_round_trip_through_their_argv(declared: type) -> None:
    settings = declared(**{f.name: other_value(f) for f in flag_fields.flag_fields(declared)})
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)  # WorkerFlags declares its own --help
    flag_fields.add_arguments(declared, parser)
    assert flag_fields.from_args(declared, parser.parse_args(flag_fields.to_argv(settings))) == settings
    required = [f for f in flag_fields.flag_fields(declared) if f.metadata.get("required")]
    if not required:  # the defaults are no flags at all
        assert flag_fields.to_argv(declared()) == []


def test_engine_config_round_trips_through_its_argv() -> None:
    config = EngineConfig(dtype="bfloat16", quantization="int8", max_total_tokens=4096, chunked_prefill_size=64,
                          kv_tier_bytes=1 << 20, kv_tier_dir="/tmp/tier", kv_share=True, replica_role="prefill,decode",
                          grammar_warm_up=False, speculative_algorithm="ngram", lora_modules=("a=/x", "b=/y"),
                          schedule_policy="lpm", mem_fraction_static=0.25)
    parser = argparse.ArgumentParser(exit_on_error=False)
    EngineConfig.add_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args(config.to_argv())) == config


def test_each_actor_parses_the_argv_the_launcher_writes_for_it_as_serve_parsed_it(tmp_path: Path) -> None:
    """The settings an actor reads from its command line are the ones `ringserve serve` parsed."""
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    args = serve_args({"model": "m", "tp": 2, "tp_timeout": 7.5, "dp": 2, "max_live_requests": 9,
                       "chunked_prefill_size": 64, "grammar_warm_up": False, "lora_modules": ["a=/x", "b=/y"],
                       "reasoning_budget": 8, "chat_template": str(template), "host": "0.0.0.0", "port": 8123,
                       "cors_allow_origins": "https://a,https://b", "allow_remote_images": True,
                       "image_ttl": 60.0, "tool_call_parser": "hermes", "otlp_endpoint": "http://c:4318"})
    shared = {"scheduler": (EngineConfig, AdmissionFlags, TensorParallelFlags, TracingFlags),
              "tokenizer": (ChatFlags, TracingFlags), "detokenizer": (TracingFlags,),
              "entry": (EntryFlags, TracingFlags)}
    for spec in actor_specs(args, "served"):
        parser = importlib.import_module(f"{spec.module}.__main__").build_parser()
        parsed = parser.parse_args(["--nats-url", "nats://127.0.0.1:4222", *spec.args])
        for declared in shared[spec.role]:
            assert flag_fields.from_args(declared, parsed) == flag_fields.from_args(declared, args), (spec, declared)
        if spec.role == "scheduler":
            assert (parsed.model, parsed.rank, parsed.dp_replica_id) == ("m", spec.rank // 1000, spec.rank % 1000)
        if spec.role == "tokenizer":
            assert parsed.grammar_warm_up is False and parsed.detokenizer_shards == args.detokenizer_shards
        if spec.role == "entry":
            assert parsed.served_model_name == "served"


def test_subcommands_parse_the_argv_written_from_their_declarations(tmp_path: Path) -> None:
    """`ringserve trace/nats-config/submit/worker`'s real parsers (mutually exclusive and required flags
    included) read back the argv to_argv writes for non-default settings."""
    auth = NatsAuthFlags(nats_creds="/c/trace_exporter.json", nats_tls_ca="/c/ca.pem")
    for where in ({"nats_url": "nats://h:4222"}, {"trace_store": str(tmp_path)}):
        trace = TraceFlags(**where, namespace="prod", steps=True, no_events=True, width=80)
        args = build_parser().parse_args(["trace", *trace_argv("chatcmpl-7", trace, auth)])
        assert args.rid == "chatcmpl-7"
        assert (flag_fields.from_args(TraceFlags, args), flag_fields.from_args(NatsAuthFlags, args)) == (trace, auth)
    hint = read_hint("nats://h:4222", "prod", tmp_path).split()
    assert hint[:3] == ["ringserve", "trace", "RID"]
    args = build_parser().parse_args(hint[1:])
    assert (args.nats_url, args.namespace, args.nats_creds) == ("nats://h:4222", "prod",
                                                                 str(tmp_path / "trace_exporter.json"))

    config = NatsConfigFlags(out=str(tmp_path / "out"), namespace="prod", client=["a", "b"], nats_url="nats://h:1",
                             cluster_nodes="a=h:1,b=h:2,c=h:3", cluster_name="c", listen="0.0.0.0:1",
                             cluster_listen="0.0.0.0:2", http_port=0, store_dir="/s")
    args = build_parser().parse_args(["nats-config", *flag_fields.to_argv(config)])
    assert flag_fields.from_args(NatsConfigFlags, args) == config
    assert flag_fields.to_argv(NatsConfigFlags(out="/o")) == ["--out", "/o"]  # required: written as given
    assert NatsConfigFlags(out="/o").node_setting("http_port") == 8222 and config.node_setting("http_port") == 0

    messages = [{"role": "user", "content": "Say \"hi\" ü"}]
    submit = SubmitFlags(nats_url="nats://h:1", namespace="prod", creds="/c.json", client="c", messages=messages,
                         sampling={"top_k": 5}, stream=True, json=True, rid="r1", timeout=5.0)
    sampling = SamplingFlags(max_new_tokens=8, temperature=0.5, stop=["a", "b"], logit_bias={"3": -1.5},
                             stop_token_ids=[1, 2], ignore_eos=True, no_skip_special_tokens=True, lora_name="l")
    args = build_parser().parse_args(["submit", *flag_fields.to_argv(submit), *flag_fields.to_argv(sampling)])
    assert flag_fields.from_args(SubmitFlags, args) == submit and flag_fields.from_args(SamplingFlags, args) == sampling
    assert given_sampling(sampling) == {"max_new_tokens": 8, "temperature": 0.5, "logit_bias": {"3": -1.5},
                                        "stop": ["a", "b"], "stop_token_ids": [1, 2], "ignore_eos": True,
                                        "skip_special_tokens": False, "lora_name": "l"}
    request = build_request(args)
    assert request.rid == "r1" and request.stream and request.sampling == {"top_k": 5, **given_sampling(sampling)}
    unset = build_parser().parse_args(["submit", "--text", "hi"])
    assert build_request(unset).sampling == {"max_new_tokens": 128}  # unset parameters keep their defaults

    assert role_argv("entry", [*flag_fields.to_argv(EntryModelFlags(model="x", served_model_name="n")), "--port",
                               "1"]) == ["--port", "1", "--served-model-name", "n"]
