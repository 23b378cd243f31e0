"""Per-request timings and their per-level summary (throughput; mean, p50, p99 of TTFT, ITL, TPOT, e2e)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """One streamed request. Times in seconds from when it was sent; `itls` are gaps between text chunks."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server's prefix cache supplied (usage.prompt_tokens_details)
    chunks: int = 0  # streamed chunks that carried text
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """(e2e − TTFT) / (tokens − 1): the mean time per output token after the first; None for one token."""
        if self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stats(values: list[float]) -> dict[str, float]:
    """mean, p50 and p99 of `values` (NaN when empty)."""
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99)}


@dataclass
class LevelSummary:
    """What one concurrency level (or request rate) measured. Latencies in milliseconds."""

    mode: str  # "concurrency" or "rate"
    level: float
    requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_tok_s: float
    total_tok_s: float
    mean_prompt_tokens: float
    mean_completion_tokens: float
    tokens_per_chunk: float  # > 1 when the server streams several tokens in one chunk
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: list[str]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN becomes None)."""
        return json_safe(asdict(self))


def summarise(mode: str, level: float, results: list[RequestResult], duration: float) -> LevelSummary:
    """Aggregate one level's request results over its wall-clock `duration` (first send to last finish)."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    gaps = sum(len(r.itls) for r in done)
    ms = 1e3
    return LevelSummary(
        mode=mode, level=level, requests=len(results), completed=len(done), failed=len(results) - len(done),
        duration_s=duration,
        request_throughput=len(done) / duration if duration else math.nan,
        output_tok_s=out_tokens / duration if duration else math.nan,
        total_tok_s=(out_tokens + in_tokens) / duration if duration else math.nan,
        mean_prompt_tokens=in_tokens / len(done) if done else math.nan,
        mean_completion_tokens=out_tokens / len(done) if done else math.nan,
        tokens_per_chunk=sum(max(0, r.completion_tokens - 1) for r in done) / gaps if gaps else math.nan,
        ttft_ms=stats([r.ttft * ms for r in done]),
        itl_ms=stats([g * ms for r in done for g in r.itls]),
        tpot_ms=stats([t * ms for r in done if (t := r.tpot) is not None]),
        e2e_ms=stats([r.e2e * ms for r in done]),
        errors=sorted({r.error for r in results if not r.ok})[:5],
    )


def json_safe(value: Any) -> Any:
    """`value` with every NaN float (in nested dicts and lists) replaced by None."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _triple(s: dict[str, float], scale: float = 1.0, digits: int = 0) -> str:
    return "/".join(f"{s[k] * scale:.{digits}f}" if not math.isnan(s[k]) else "-" for k in ("mean", "p50", "p99"))


def format_table(levels: list[LevelSummary]) -> str:
    """The per-level table: throughput, then latency triples (mean/p50/p99)."""
    head = levels[0].mode if levels else "concurrency"
    rows = [[head, "reqs", "ok", "req/s", "out tok/s", "tot tok/s", "TTFT ms", "ITL ms", "TPOT ms", "E2E s",
             "tok/chunk"]]
    for s in levels:
        rows.append([f"{s.level:g}", str(s.requests), str(s.completed), f"{s.request_throughput:.2f}",
                     f"{s.output_tok_s:.1f}", f"{s.total_tok_s:.1f}", _triple(s.ttft_ms), _triple(s.itl_ms, digits=1),
                     _triple(s.tpot_ms, digits=1), _triple(s.e2e_ms, 1e-3, 2), f"{s.tokens_per_chunk:.2f}"])
    return render(rows, note="latencies: mean/p50/p99")


def render(rows: list[list[str]], note: str = "") -> str:
    """Right-aligned plain-text table; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + ([f"({note})"] if note else []))
