"""The benchmark's PNG: output throughput, and p50 ITL / TTFT, against concurrency (or request rate)."""

from __future__ import annotations

from typing import Any


def plot(report: dict[str, Any], path: str) -> None:
    """Draw `report` (the JSON the benchmark writes) to `path`; needs matplotlib (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    mode = levels[0]["mode"] if levels else "concurrency"
    x = [s["level"] for s in levels]
    xlabel = "concurrent streams" if mode == "concurrency" else "request rate (req/s, Poisson)"
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.8))

    ax_tput.plot(x, [s["output_tok_s"] for s in levels], "o-", label="ringserve (HTTP)")
    for key, label, style in (("hf_baseline", "transformers static batch", "s--"),
                              ("engine_baseline", "ringserve engine in-process", "^:")):
        base = report.get(key) or {}
        pts = sorted((int(k), v["output_tok_s"]) for k, v in base.items())
        if pts:
            ax_tput.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax_tput.set_xlabel(xlabel)
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_title("Throughput")

    ax_lat.plot(x, [s["itl_ms"]["p50"] for s in levels], "o-", label="ITL p50")
    ax_lat.plot(x, [s["tpot_ms"]["p50"] for s in levels], "d-", label="TPOT p50")
    ax_lat.set_xlabel(xlabel)
    ax_lat.set_ylabel("ms per token")
    ax_lat.set_title("Latency")
    ax_ttft = ax_lat.twinx()
    ax_ttft.plot(x, [s["ttft_ms"]["p50"] for s in levels], "s--", color="tab:red", label="TTFT p50 (right)")
    ax_ttft.set_ylabel("TTFT ms")
    handles = ax_lat.get_legend_handles_labels()
    more = ax_ttft.get_legend_handles_labels()
    ax_lat.legend(handles[0] + more[0], handles[1] + more[1], loc="best")

    for ax in (ax_tput, ax_lat):
        if mode == "concurrency" and len(x) > 1 and max(x) / max(min(x), 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    ax_tput.legend(loc="best")
    ax_tput.set_ylim(bottom=0)
    ax_lat.set_ylim(bottom=0)
    ax_ttft.set_ylim(bottom=0)
    cfg = report["config"]
    fig.suptitle(f"{cfg['model']} · {cfg['max_tokens']} new tokens · {report['machine']['cpu']} "
                 f"({report['machine']['cores']} cores) · {report['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
