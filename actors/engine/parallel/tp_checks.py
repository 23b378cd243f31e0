"""Whether a model and a quantization can run over `--tp` ranks: checked by the launcher before any process
starts, and again by each rank (no torch here, so the launcher stays light)."""

from __future__ import annotations

from typing import Any

DEFAULT_TIMEOUT_S = 3.0  # a live peer answers a collective in milliseconds; a dead or stopped one never


def check_shardable(config: Any, tp: int) -> None:
    """Raise ValueError saying why `config`'s model cannot be split over `tp` ranks."""
    heads, kv_heads, inner = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if heads % tp:
        raise ValueError(f"--tp {tp} must divide the model's {heads} attention heads")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"--tp {tp} must divide the model's {kv_heads} KV heads or be a multiple of them "
                         f"(then each KV head is replicated)")
    if inner % tp:
        raise ValueError(f"--tp {tp} must divide the model's MLP size {inner}")


def check_tp_quantization(tp: int, method: str) -> None:
    """Raise ValueError when `--quantization method` cannot run on a shard (`gguf` runs the file's own blocks,
    which are not split by rank); int8 and int4 quantize each rank's shard."""
    if tp > 1 and method == "gguf":
        raise ValueError("--quantization gguf runs the GGUF file's own blocks, which are not split by rank: "
                         "use int8 or int4 with --tp")
