"""Whether a model and a quantization can run over `--tp` ranks: checked by the launcher before any process
starts, and again by each rank (no torch here, so the launcher stays light)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

DEFAULT_TIMEOUT_S = 3.0
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")  # Mixtral, Qwen, DeepSeek  # a live peer answers a collective in milliseconds; a dead or stopped one never


def text_config(config: Any) -> Any:
    """The config of the text model that is sharded: a vision-language checkpoint's `text_config` (as attributes;
    resolved configs keep it a dict), else `config` itself (a vision tower is never sharded)."""
    text = getattr(config, "text_config", None)
    if text is None:
        return config
    return SimpleNamespace(**text) if isinstance(text, dict) else text


def check_shardable(config: Any, tp: int) -> None:
    """Raise ValueError saying why `config`'s model cannot be split over `tp` ranks."""
    config = text_config(config)
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
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # each expert is sliced like an MLP
        size = getattr(config, field, None) or 0
        if size % tp:
            raise ValueError(f"--tp {tp} must divide the model's {field} {size}")


def check_expert_parallel(config: Any, tp: int, ep: int) -> None:
    """Raise ValueError saying why `--ep ep` cannot place `config`'s experts over `tp` ranks."""
    if ep == 1:
        return
    config = text_config(config)
    if ep != tp:
        raise ValueError(f"--ep must be 1 or equal to --tp ({tp}): experts are placed over the tensor-parallel "
                         f"ranks, got {ep}")
    experts = next((getattr(config, f) for f in EXPERT_COUNT_FIELDS if getattr(config, f, None)), 0)
    if not experts:
        raise ValueError(f"--ep applies to mixture-of-experts models; {getattr(config, 'model_type', 'this model')} "
                         "has no experts")
    if experts % ep:
        raise ValueError(f"--ep {ep} must divide the model's {experts} experts")


def check_tp_quantization(tp: int, method: str) -> None:
    """Raise ValueError when `--quantization method` cannot run on a shard (`gguf` runs the file's own blocks,
    which are not split by rank); int8 and int4 quantize each rank's shard."""
    if tp > 1 and method == "gguf":
        raise ValueError("--quantization gguf runs the GGUF file's own blocks, which are not split by rank: "
                         "use int8 or int4 with --tp")
