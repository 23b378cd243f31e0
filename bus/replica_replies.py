"""One answer from the answers of every scheduler replica (`--dp`): operator commands and load reports.

The info query and the operator commands are NATS requests every replica answers (`BusConnection.gather`);
the entry and the Python client both turn the gathered replies into one with these functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ringserve.bus.messages import ControlReply, ReplicaLoad, SchedulerInfo

# operator commands and load queries wait for every replica heard within this many of its heartbeat intervals;
# routing (MISSED_BEATS) gives up sooner, since a request can go elsewhere and a command cannot
ASKED_BEATS = 20

# per replica in /get_server_info's `replicas`, beside `id`, `tp_size` and `up`
REPLICA_FIELDS = ("requests_routed", "num_running_reqs", "num_waiting_reqs", "kv_used_tokens", "kv_total_tokens",
                  "cache_hit_rate", "decode_graphs", "kv_tier_loaded_blocks", "kv_fetched_blocks", "kv_fetch_failures",
                  "kv_served_blocks")

SUMMED_INFO = ("num_running_reqs", "num_waiting_reqs", "kv_used_tokens", "kv_total_tokens", "kv_running_tokens",
               "kv_cached_tokens", "num_retractions", "requests_routed", "spec_drafted_tokens", "spec_accepted_tokens",
               "spec_emitted_tokens", "spec_verify_rows", "kv_tier_blocks", "kv_tier_bytes", "kv_tier_saved_blocks",
               "kv_tier_loaded_blocks", "kv_tier_loaded_bytes", "kv_tier_load_seconds", "kv_tier_corrupt_blocks",
               "kv_fetched_blocks", "kv_fetched_bytes", "kv_fetch_seconds", "kv_fetch_failures", "kv_served_blocks")


def left(load: ReplicaLoad, live_rids: int) -> bool:
    """Whether the replica whose last beat carried `load` and `live_rids` left on purpose: drained, holding
    nothing (its silence is no loss)."""
    return load.draining and live_rids == 0


def asked(load: ReplicaLoad, live_rids: int, silent_s: float) -> bool:
    """Whether a command or load query waits for the replica whose last beat carried `load` and `live_rids`,
    `silent_s` seconds ago: unless it left or was silent for ASKED_BEATS beats. A replica whose loop was busy
    for a few beats (a long step on a loaded host) answers late, not never."""
    return not left(load, live_rids) and silent_s <= ASKED_BEATS * load.interval


def combined_info(infos: list[SchedulerInfo]) -> SchedulerInfo:
    """One report for several replicas: the first one's settings, the load counters summed, the prefix-cache
    hit rate weighted by each replica's share of the requests."""
    if len(infos) == 1:
        return infos[0]
    total = dataclasses.replace(infos[0], **{name: sum(getattr(i, name) for i in infos) for name in SUMMED_INFO})
    routed = sum(i.requests_routed for i in infos)
    if routed:
        total.cache_hit_rate = sum(i.cache_hit_rate * i.requests_routed for i in infos) / routed
    return total


def replica_entry(info: SchedulerInfo) -> dict[str, Any]:
    """One replica's object in `/get_server_info`'s `replicas` (a replica that answered is up)."""
    return {"id": info.rank, "tp_size": info.tp_size, "up": True, **{key: getattr(info, key) for key in REPLICA_FIELDS}}


def combined_reply(replies: list[ControlReply], expected: int) -> ControlReply:
    """One answer to a command sent to `expected` replicas, from the `replies` that came (at least one).

    Ok only when every expected replica answered ok; the first error; integer details summed (tokens freed,
    requests held), except durations (`*_ms`: the longest), other details from the first reply.
    """
    first = replies[0]
    if len(replies) == 1 and expected <= 1:
        return first
    detail: dict[str, int | str] = {}
    for reply in replies:
        for key, value in reply.detail.items():
            old = detail.get(key)
            if isinstance(value, int) and isinstance(old, int):
                detail[key] = max(old, value) if key.endswith("_ms") else old + value
            elif old is None:
                detail[key] = value
    message = "; ".join(dict.fromkeys(r.message for r in replies if r.message))
    if len(replies) < expected:
        message = f"only {len(replies)} of {expected} scheduler replicas answered: {message}"
    return ControlReply(ok=len(replies) >= expected and all(r.ok for r in replies), message=message, detail=detail,
                        error=next((r.error for r in replies if r.error is not None), None))
