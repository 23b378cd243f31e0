"""ERNIE 4.5 (Baidu, dense): Llama's layer with one bias switch for every linear (`use_bias`) and a rotary
embedding over interleaved pairs of each head's dims `(0, 1), (2, 3), ...` (GLM's layout). Its q and k rows are
reordered once at load to halves `0, 2, ... | 1, 3, ...`, which the shared rotary rotates exactly as
transformers' interleaved one does (q·k is unchanged when q and k share the order)."""

from typing import Any

import torch

from ringserve.actors.engine.models.spec import ArchSpec, head_dim_of


def _use_bias(config: Any) -> bool:
    return bool(getattr(config, "use_bias", False))


def _halves(rows: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """`rows` (a projection's weight or bias, `heads * head_dim` rows) with each head's rows in halves order."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return rows.reshape(heads, head_dim, -1)[:, order].reshape(rows.shape)


def _deinterleave_qk(tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    head_dim = head_dim_of(config)
    q_rows = config.num_attention_heads * head_dim
    k_rows = config.num_key_value_heads * head_dim
    out = dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            q, k, v = tensor.split([q_rows, k_rows, tensor.shape[0] - q_rows - k_rows])
            out[name] = torch.cat([_halves(q, config.num_attention_heads, head_dim),
                                   _halves(k, config.num_key_value_heads, head_dim), v])
    return out


SPEC = ArchSpec(name="ernie4_5", qkv_bias=_use_bias, o_bias=_use_bias, mlp_bias=_use_bias,
                prepare_weights=_deinterleave_qk)
