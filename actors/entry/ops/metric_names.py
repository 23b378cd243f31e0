"""Other servers' metric names for `GET /metrics?names=vllm` or `?names=sglang`, so a Grafana dashboard built
for vLLM or SGLang reads ringserve without edits (set `params: {names: [vllm]}` in the Prometheus scrape job).

The mapping is one table per dialect, ringserve name (without `ringserve:`) -> theirs; a series with no
counterpart keeps its `ringserve:` name. Label names are renamed where theirs differ. docs/metrics.md lists
the tables (generated from `MAPPINGS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import Metric
from prometheus_client.samples import Sample

PREFIX = "ringserve:"
# ringserve name -> (their name, {our label: their label})
MAPPINGS: dict[str, dict[str, tuple[str, dict[str, str]]]] = {
    "vllm": {
        "prompt_tokens": ("vllm:prompt_tokens", {}),
        "generation_tokens": ("vllm:generation_tokens", {}),
        "cached_tokens": ("vllm:prefix_cache_hits", {}),
        "num_requests": ("vllm:request_success", {"finish_reason": "finished_reason"}),
        "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", {}),
        "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", {}),
        "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", {}),
        "request_queue_time_seconds": ("vllm:request_queue_time_seconds", {}),
        "num_running_reqs": ("vllm:num_requests_running", {}),
        "num_queue_reqs": ("vllm:num_requests_waiting", {}),
        "token_usage": ("vllm:kv_cache_usage_perc", {}),
        "spec_drafted_tokens": ("vllm:spec_decode_num_draft_tokens", {}),
        "spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", {}),
        "spec_emitted_tokens": ("vllm:spec_decode_num_emitted_tokens", {}),
        "spec_verify_rows": ("vllm:spec_decode_num_drafts", {}),
    },
    "sglang": {
        "prompt_tokens": ("sglang:prompt_tokens", {}),
        "generation_tokens": ("sglang:generation_tokens", {}),
        "cached_tokens": ("sglang:cached_tokens", {}),
        "num_requests": ("sglang:num_requests", {}),
        "time_to_first_token_seconds": ("sglang:time_to_first_token_seconds", {}),
        "inter_token_latency_seconds": ("sglang:inter_token_latency_seconds", {}),
        "e2e_request_latency_seconds": ("sglang:e2e_request_latency_seconds", {}),
        "request_queue_time_seconds": ("sglang:queue_time_seconds", {}),
        "num_running_reqs": ("sglang:num_running_reqs", {}),
        "num_queue_reqs": ("sglang:num_queue_reqs", {}),
        "token_usage": ("sglang:token_usage", {}),
        "cache_hit_rate": ("sglang:cache_hit_rate", {}),
        "num_retractions": ("sglang:num_retracted_reqs", {}),
        "spec_accept_length": ("sglang:spec_accept_length", {}),
    },
}
DIALECTS = ("ringserve", *MAPPINGS)


def renamed(families: Iterable[Metric], dialect: str) -> Iterator[Metric]:
    """`families` under `dialect`'s names (`ringserve`: unchanged); ValueError for an unknown dialect."""
    if dialect == "ringserve":
        yield from families
        return
    if dialect not in MAPPINGS:
        raise ValueError(f"unknown metric names {dialect!r}; one of {list(DIALECTS)}")
    table = MAPPINGS[dialect]
    for family in families:
        ours = family.name.removeprefix(PREFIX)
        if ours not in table:
            yield family
            continue
        theirs, labels = table[ours]
        copy = Metric(theirs, family.documentation, family.type, family.unit)
        copy.samples = [Sample(theirs + s.name[len(family.name):], {labels.get(k, k): v for k, v in s.labels.items()},
                               s.value, s.timestamp, s.exemplar) for s in family.samples]
        yield copy
