"""The flags that say which part of a deployment an actor process is (its model, its rank, replica or shard),
declared once as dataclass fields (actors/common/flag_fields.py): each actor's parser takes them, and the
launcher writes them per process with `to_argv` (actors/launcher/ring.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import MODEL, SCALE_OUT


@dataclass
class ActorModelFlags:
    """The model of an actor that loads one (the scheduler, a tokenizer, a detokenizer)."""

    model: str = field(default="", metadata=flag(
        "model name, .gguf file or model directory", group=MODEL, required=True))


@dataclass
class SchedulerProcessFlags(ActorModelFlags):
    """Which rank of which replica a scheduler process is."""

    rank: int = field(default=0, metadata=flag(
        "this process's tensor-parallel rank in its replica: 0 reads NATS and schedules, 1..tp-1 run rank 0's step "
        "plans (actors/scheduler/tp_follower.py)", group=SCALE_OUT))
    dist_init_addr: str = field(default="", metadata=flag(
        "with --tp > 1: where rank 0 of this replica listens for its other ranks (the same for every rank of the "
        "replica)", group=SCALE_OUT, metavar="HOST:PORT"))
    dp_replica_id: int | None = field(default=None, metadata=flag(
        "this scheduler replica's id (`--dp`): its subject, heartbeat and server-info entry; claimed on the bus, so "
        "no two live replicas share one. Left out: the lowest free id", group=SCALE_OUT, type=int))


@dataclass
class TokenizerProcessFlags(ActorModelFlags):
    """What a tokenizer process is told of the deployment."""

    detokenizer_shards: int = field(default=1, metadata=flag(
        "detokenizers the launcher starts (ids 0..N-1): chosen among until one has beat; afterwards each request "
        "goes to one of the live detokenizers", group=SCALE_OUT))


@dataclass
class DetokenizerProcessFlags(ActorModelFlags):
    """Which detokenizer a detokenizer process is."""

    shard: int = field(default=0, metadata=flag(
        "this detokenizer's id: it serves `{ns}.tokens.{shard}`, and tokenizers choose it for new requests from its "
        "heartbeats", group=SCALE_OUT))


@dataclass
class EntryProcessFlags:
    """The name the entry serves the model under (`ringserve serve` derives it from --model)."""

    served_model_name: str = field(default="", metadata=flag(
        "model id shown in /v1/models", group=MODEL, required=True))
