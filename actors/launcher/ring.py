"""One deployment as `ringserve serve` starts it, for the CLI and for `ringserve.Engine`.

`Ring(args)` checks the serve flags, that the HTTP port is free and `--nats-url` answers
(actors/launcher/preflight.py), and plans everything (the model, read once: its GGUF header or config files,
never its tensors; the NATS URL and every role's credentials, the span buffer, the actor processes;
`--tool-call-parser auto` and `--reasoning-parser auto` resolved from the chat template, `--chat-template`'s or
the model's), logging what it does from its first line; `start_nats` starts the embedded nats-server (unless
`--nats-url` names one), `supervisor` builds the `Supervisor` that starts and watches the actors, and `close`
stops the server and deletes the private credential and trace directories. With `http=False` the ring has no
entry actor: the scheduler, tokenizers and detokenizers only, for a caller that talks to the ring over NATS
itself (the Python `Engine`, as the entry role).
"""

from __future__ import annotations

import argparse
import logging
import time

from ringserve.actors.common.checkpoint_quantization import check_checkpoint_quantization
from ringserve.actors.common.flag_fields import from_args, to_argv
from ringserve.actors.common.model_catalog import context_length
from ringserve.actors.common.model_source import check_servable, model_chat_template, resolve_model, resolved_config
from ringserve.actors.common.process_flags import (
    DetokenizerProcessFlags, EntryProcessFlags, SchedulerProcessFlags, TokenizerProcessFlags,
)
from ringserve.actors.common.reasoning import parser_for_template as reasoning_parser_for_template
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.parallel.tp_checks import check_expert_parallel, check_shardable, check_tp_quantization
from ringserve.actors.entry.settings import entry_argv
from ringserve.actors.entry.tool_parsers import AUTO, parser_for_template
from ringserve.actors.launcher.nats_auth import NatsPlan, plan_nats
from ringserve.actors.launcher.preflight import EndpointError, check_endpoints, check_http_port
from ringserve.actors.launcher.supervisor import ActorSpec, Supervisor
from ringserve.actors.launcher.trace_buffer import TraceBuffer, actor_tracing_argv, plan_trace_buffer, trace_exporter_specs
from ringserve.actors.scheduler.admission import AdmissionFlags
from ringserve.actors.scheduler.tp_follower import TensorParallelFlags, follower_rank
from ringserve.actors.tokenizer.chat_options import ChatOptions, chat_argv
from ringserve.actors.tokenizer.generation_defaults import generation_defaults
from ringserve.bus.credentials import CredentialsError, NatsCredentials
from ringserve.bus.embedded_server import EmbeddedNatsServer, free_port
from ringserve.bus.subjects import Subjects
from ringserve.observability.logging import log_event

log = logging.getLogger("launcher")


class RingError(ValueError):
    """Serve flags that cannot make a ring (an unknown model, clashing NATS options, ...); says which."""


def actor_specs(args: argparse.Namespace, served_name: str, trace: TraceBuffer | None = None,
                http: bool = True) -> list[ActorSpec]:
    """The processes of one deployment: `--dp` scheduler replicas (`--tp` processes each), tokenizers,
    detokenizers, the entry (unless not `http`) and the trace exporter when `trace` buffers spans."""
    common = ["--log-level", args.log_level, *actor_tracing_argv(args)]
    engine = [*to_argv(from_args(AdmissionFlags, args)), *EngineConfig.from_args(args).to_argv()]
    # `--tp` > 1: each replica is a rank group on a free loopback port, restarted as a whole (tp_follower.py)
    tensor_parallel = to_argv(from_args(TensorParallelFlags, args)) if args.tp > 1 else []
    addresses = [f"127.0.0.1:{free_port()}" if args.tp > 1 else "" for _ in range(args.dp)]
    specs = [ActorSpec("scheduler", follower_rank(r, k), "ringserve.actors.scheduler",
                       [*common, *to_argv(SchedulerProcessFlags(args.model, k, addresses[r], r)), *tensor_parallel,
                        *engine], group=f"scheduler{r}" if args.tp > 1 else "")
             for r in range(args.dp) for k in range(args.tp)]
    tokenizer = [*common, *to_argv(TokenizerProcessFlags(args.model, args.detokenizer_shards)),
                 *chat_argv(ChatOptions.from_args(args)),
                 *EngineConfig(grammar_warm_up=args.grammar_warm_up,  # its checker's, as the scheduler's
                               context_length=args.context_length).to_argv()]
    specs += [ActorSpec("tokenizer", i, "ringserve.actors.tokenizer", [*tokenizer])
              for i in range(args.tokenizer_workers)]
    specs += [ActorSpec("detokenizer", i, "ringserve.actors.detokenizer",
                        [*common, *to_argv(DetokenizerProcessFlags(args.model, i))])
              for i in range(args.detokenizer_shards)]
    if http:
        specs.append(ActorSpec("entry", 0, "ringserve.actors.entry",
                               [*common, *to_argv(EntryProcessFlags(served_name)), *entry_argv(args)], stage=1))
    return specs + (trace_exporter_specs(trace, common) if trace is not None else [])


class Ring:
    """The plan of one deployment and the embedded nats-server it runs on."""

    def __init__(self, args: argparse.Namespace, http: bool = True) -> None:
        """Check `args` (the serve flags) and plan; raises RingError saying what is wrong."""
        self.args = args
        self.http = http
        started = time.perf_counter()
        try:
            if http:  # before the model is read: a clash is the first and only line
                check_http_port(args.host, args.port)
            log_event(log, logging.INFO, "reading the model", model=args.model)
            self.source = resolve_model(args.model)
            check_servable(self.source)  # weights and a tokenizer, before any actor starts
            if self.source.gguf_file is None:  # a quantization_config we serve, and no --quantization on top of it
                check_checkpoint_quantization(self.source.directory, args.quantization, args.tp, args.device,
                                              args.dtype)
            self.subjects = Subjects(args.namespace)
            engine_config = EngineConfig.from_args(args)
            if engine_config.context_length is not None:  # longer than the model's: refused before any actor starts
                engine_config.served_context_length(context_length(resolved_config(self.source)))
            chat = ChatOptions.from_args(args)  # a bad --chat-template or kwargs JSON, before any actor starts
            generation_defaults(self.source, args.generation_config)  # a generation_config.json no request takes
            if args.tp != 1 or args.ep != 1:  # heads that --tp does not divide: refused before any process starts
                check_shardable(resolved_config(self.source), args.tp)
                check_expert_parallel(resolved_config(self.source), args.tp, args.ep)
                check_tp_quantization(args.tp, args.quantization)
        except (FileNotFoundError, ValueError) as exc:
            raise RingError(str(exc)) from exc
        if args.quantization == "gguf" and self.source.gguf_file is None:
            raise RingError(f"--quantization gguf runs a .gguf model's own blocks; {args.model!r} is not a GGUF model "
                            "(use int8 or int4)")
        if args.tokenizer_workers < 1 or args.detokenizer_shards < 1 or args.dp < 1:
            raise RingError("--dp, --tokenizer-workers and --detokenizer-shards must be >= 1")
        self.served_name: str = args.served_model_name or self.source.name
        for adapter, base in engine_config.lora_base_models().items():
            if base not in (self.served_name, args.model):
                raise RingError(f"--lora-modules: adapter {adapter!r} is for base model {base!r}, but this server "
                                f"serves {self.served_name!r} ({args.model}); an adapter applies to the served model")
        # the model is read once: check_servable and the chat template share one read of a GGUF's header
        # (model_source.gguf_metadata, never its tensors), and what it tells goes to the actors as flags
        if AUTO in (args.tool_call_parser, args.reasoning_parser):  # the formats the chat template asks for
            template = chat.chat_template if chat.chat_template is not None else model_chat_template(self.source)
            if args.tool_call_parser == AUTO:
                args.tool_call_parser = parser_for_template(template)
                log_event(log, logging.INFO, "tool-call parser chosen from the chat template",
                          parser=args.tool_call_parser)
            if args.reasoning_parser == AUTO:
                args.reasoning_parser = reasoning_parser_for_template(template)
                log_event(log, logging.INFO, "reasoning parser chosen from the chat template",
                          parser=args.reasoning_parser)
        try:
            self.trace = plan_trace_buffer(args)
        except ValueError as exc:
            raise RingError(str(exc)) from exc
        try:
            self.plan: NatsPlan = plan_nats(args, self.subjects.namespace)
        except (ValueError, CredentialsError) as exc:
            self.trace.cleanup()
            raise RingError(str(exc)) from exc
        try:
            check_endpoints(args, self.plan.url, self.plan.external, http=False)  # the HTTP port was checked first
        except EndpointError as exc:
            self.plan.cleanup()
            self.trace.cleanup()
            raise RingError(str(exc)) from exc
        log_event(log, logging.INFO, "model read and serve flags checked", model=self.served_name,
                  format="gguf" if self.source.gguf_file else "safetensors",
                  seconds=round(time.perf_counter() - started, 2))
        self.nats: EmbeddedNatsServer | None = None

    @property
    def url(self) -> str:
        """The NATS URL (never with credentials in it)."""
        return self.plan.url

    def start_nats(self) -> None:
        """Start the embedded nats-server (nothing on an external NATS) and log the clients' credentials files."""
        plan = self.plan
        if plan.external:
            return
        self.nats = EmbeddedNatsServer(port=plan.port,
                                       extra_config=plan.authorization + self.trace.server_config(plan.external)).start()
        if self.nats.process is not None:
            log_event(log, logging.INFO, "started nats-server", pid=self.nats.process.pid, url=self.url)
        if plan.generated is not None:
            log_event(log, logging.INFO, "nats per-role users", credentials_dir=str(plan.generated.directory))
            for name, path in plan.generated.client_files.items():
                log_event(log, logging.INFO, "nats client credentials", client=name, file=str(path))

    def credentials(self, role: str) -> NatsCredentials | None:
        """The credentials an in-process caller acting as internal `role` connects with: the generated user of the
        embedded server, else what the serve flags give the launcher (None: unauthenticated)."""
        if self.plan.generated is not None:
            return self.plan.generated.credentials(role)
        return self.plan.launcher_credentials

    def supervisor(self) -> Supervisor:
        """The supervisor of this ring's actors (each with its role's credentials), watching the nats-server too."""
        process = self.nats.process if self.nats is not None else None
        watched = {"nats-server": process} if process is not None else {}
        specs = actor_specs(self.args, self.served_name, self.trace, self.http)
        for spec in specs:
            spec.args = [*self.plan.role_args(spec.role), *spec.args]
        return Supervisor(specs, self.url, self.subjects, watched, self.args.watchdog_timeout,
                          credentials=self.plan.launcher_credentials)

    def close(self) -> None:
        """Stop the embedded nats-server; delete the private credential and span-store directories."""
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        self.plan.cleanup()
        self.trace.cleanup()
