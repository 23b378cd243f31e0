"""Read and check a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) without peft.

Each of the adapter's `lora_A [r, in]` / `lora_B [out, r]` pairs is mapped to our linear and fused part
(`models/adapter_names.py`) and checked against our model's shapes; B is scaled by `lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`). `fan_in_fan_out` only changes how PEFT merges into a Conv1D base:
the A/B it saves are the same, so it is accepted. What we do not run is refused naming it: DoRA, LoRA biases,
`modules_to_save`, embedding or LM-head LoRA, per-module rank or alpha patterns, ranks above `--max-lora-rank`.
Under tensor parallelism each rank keeps its shard's slice (`tensor_parallel.ShardSlice`): B's rows of a
column-parallel linear's parts, A's columns of a row-parallel one's input (whose all-reduce then sums the
ranks' low-rank terms with their base outputs).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ringserve.actors.engine.lora.lora_linear import local_linear
from ringserve.actors.engine.models.adapter_names import adapter_target, fused_rows
from ringserve.actors.engine.models.causal_lm import CausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TENSOR_NAME = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")


class AdapterError(ValueError):
    """An adapter that cannot be served, saying why."""


@dataclass
class Adapter:
    """A checked adapter: per our linear (`(layer, module)`), per fused part, `(A [r, in], B [rows, r])` with
    the scale folded into B, on the CPU in the model's dtype."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]


def load_adapter(name: str, path: str, model: CausalLM, max_rank: int) -> Adapter:
    """The adapter at directory `path` for `model`; AdapterError saying what is wrong or unsupported."""
    directory = Path(path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"LoRA adapter {name!r}: {f} does not exist (a PEFT adapter directory holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} is not valid JSON ({e})") from None
    rank, scale = _check_config(name, config, max_rank)
    tensors = _read(name, weights_file)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = TENSOR_NAME.fullmatch(key)
        if match is None:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight (DoRA magnitudes, "
                               "biases, embeddings and modules_to_save are not supported)")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    layers = model.decoder_layers()
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: {module} has lora_{'AB'[('A' in pair)]} without its pair")
        try:
            target = adapter_target(model, module)
        except ValueError as e:
            raise AdapterError(f"LoRA adapter {name!r}: {e}") from None
        owner_name, _, leaf = target.module.partition(".")
        owner = getattr(layers[target.layer], owner_name)
        linear = local_linear(owner, leaf)
        rows = fused_rows(owner, target.module)[target.part] if target.parts > 1 else linear.out_features
        inputs = linear.in_features
        shard = getattr(owner, "tp_shard", {}).get(leaf)  # this rank's slice under tensor parallelism
        if shard is not None and shard.kind == "rows":
            rows = shard.slices[target.part][2]
        elif shard is not None:
            inputs = shard.slices[0][2]
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, inputs) or b.shape != (rows, rank):
            raise AdapterError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)}; this model needs ({rank}, {inputs}) and ({rows}, {rank})")
        if shard is not None:  # B's rows of this rank's heads/inner slice, or A's columns of its input slice
            start, end, _ = shard.slices[target.part if shard.kind == "rows" else 0]
            a, b = (a, b[start:end]) if shard.kind == "rows" else (a[:, start:end], b)
        weights.setdefault((target.layer, target.module), {})[target.part] = (
            a.to(model.dtype).contiguous(), (b.float() * scale).to(model.dtype).contiguous())
    if not weights:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    return Adapter(name, str(directory), rank, weights)


def _check_config(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale, after refusing what its config asks that we do not run."""
    def refuse(what: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r}: {what} is not supported")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora)")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config.get('bias')!r} (only 'none')")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config.get('modules_to_save')!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise refuse(f"a per-module {key}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"LoRA adapter {name!r}: adapter_config.json needs an integer r >= 1 and a lora_alpha")
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _read(name: str, weights_file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(weights_file))
    except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} is not a readable safetensors file ({e})") from None
