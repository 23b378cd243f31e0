"""Build our model from Hugging Face weights: from a model on disk, or from an in-memory config + state dict.

A safetensors directory is read directly (its config as transformers resolves it, `resolved_config`, cached
so that no start but the first imports transformers). A GGUF goes through transformers' `from_pretrained`,
which de-quantizes it; that takes most of a cold start, so the result is kept as safetensors (fused
projections, in the load dtype) in the cache, and a warm start reads it directly. Our model is built on the
meta device and the tensors are assigned into it, so no memory is spent on a random initialization. A GPTQ or
AWQ checkpoint's quantized linears are made from their codes instead (models/checkpoint_linears.py).

Weights swapped without a restart (`update_weights_from_disk`): `load_checkpoint` reads a new checkpoint on
the CPU (while the old weights keep serving), `swap_weights` checks that it has the running model's
architecture (config and every tensor's shape; `WeightMismatch` lists what differs) and copies it into the
running model's tensors in place, so CUDA graphs and kernels that hold them see the new values; quantized layers
(`--quantization`) are quantized again from the new float weights, and the bfloat16 copies float linears keep
(kernels/float_linear.py) are refreshed.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringserve.actors.common import startup_cache
from ringserve.actors.common.model_source import (
    ModelSource, cache_root, converting, gguf_cache_key, publish_directory, resolve_model, resolved_config,
)
from ringserve.actors.engine.execution_plan import ExecutionPlan, plain_execution
from ringserve.actors.engine.models.causal_lm import CausalLM, build_model
from ringserve.actors.engine.models.checkpoint_linears import (
    checkpoint_linears, install_checkpoint_linears, without_code_tensors,
)
from ringserve.actors.engine.models.hf_fusion import fuse_hf_state_dict
from ringserve.actors.engine.models.spec import head_dim_of
from ringserve.kernels.cpu.checkpoint_codes import CODE_TENSORS, is_quantized_checkpoint
from ringserve.kernels.quantization import PACKED_METHODS
from ringserve.observability.logging import log_event

log = logging.getLogger("engine.weights")

WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
IGNORED_TENSORS = (".rotary_emb.inv_freq",)  # kept by some older checkpoints; computed, not loaded
FP8_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # block-scaled FP8 checkpoints' scales


def load_model(source: ModelSource, dtype: torch.dtype, device: str | torch.device,
               plan: ExecutionPlan | None = None) -> CausalLM:
    """Load `source` in `dtype` onto `device`, built with the engine's execution `plan` (`model_from_hf`): a
    safetensors directory directly, a GGUF from the weight cache (converted by transformers at its first load).
    Logs a line as it starts and one with the seconds taken."""
    started = time.perf_counter()
    cached = weight_cache_dir(source, dtype)
    model: CausalLM | None = None
    if cached is None:
        log_event(log, logging.INFO, "loading weights", model=source.name, source="safetensors", device=str(device))
        model = model_from_hf(resolved_config(source), read_safetensors(Path(source.directory), dtype), device,
                              plan)
    elif not (cached / WEIGHTS_FILE).is_file():
        with converting(cached) as needed:
            if needed:
                from transformers import AutoModelForCausalLM

                log_event(log, logging.INFO, "loading weights", model=source.name, device=str(device),
                          source="gguf, converted by transformers (first start only; cached for the next)",
                          cache=str(cached))
                hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=dtype, **source.hf_kwargs())
                # the config a warm start loads the cached weights with, not transformers' object: a stored
                # decode graph is named by the module's attributes, so this start's graph serves the next ones
                model = model_from_hf(resolved_config(source), hf_model.state_dict(), device, plan)
                save_weights(model, cached)
    if cached is not None:
        startup_cache.note("gguf weights", model is None)  # None: read from the cache, not converted now
    if model is None:
        assert cached is not None
        log_event(log, logging.INFO, "loading weights", model=source.name, source="cache", device=str(device))
        model = model_from_hf(resolved_config(source), read_safetensors(cached, dtype), device, plan)
    log_event(log, logging.INFO, "weights loaded", model=source.name, seconds=round(time.perf_counter() - started, 1))
    return model


def _safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files of the checkpoint in `directory` (one file or shards)."""
    index = directory / SHARD_INDEX
    if index.is_file():
        files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no .safetensors weights (other formats are not read)")
    return files


def checkpoint_dtype(source: ModelSource) -> torch.dtype | None:
    """The dtype a safetensors checkpoint stores its matrices in (every linear's weight, the embeddings), read
    from its files' headers (no tensor is read); None for a GGUF, or matrices of several dtypes."""
    from safetensors import safe_open

    if source.gguf_file is not None:
        return None
    dtypes = set()
    for path in _safetensors_files(Path(source.directory)):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                if len(tensor.get_shape()) == 2:
                    dtypes.add(tensor.get_dtype())
    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    return names.get(dtypes.pop()) if len(dtypes) == 1 else None


def read_safetensors(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in `directory` (one file or shards), floats in `dtype` but a
    GPTQ/AWQ linear's code tensors (their fp16 scales kept as they are: bfloat16 would round them)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(directory):
        for name, tensor in load_file(path).items():
            if not name.endswith(IGNORED_TENSORS):
                codes = name.rpartition(".")[2] in CODE_TENSORS
                tensors[name] = tensor.to(dtype) if tensor.is_floating_point() and not codes else tensor
    return tensors


def weight_cache_dir(source: ModelSource, dtype: torch.dtype) -> Path | None:
    """Where the converted weights of a GGUF `source` in `dtype` live (None for safetensors sources)."""
    if source.gguf_file is None:
        return None
    return cache_root() / "weights" / f"{gguf_cache_key(source)}-{str(dtype).removeprefix('torch.')}"


def save_weights(model: CausalLM, directory: Path) -> None:
    """Write `model`'s tensors (a tied LM head once) as safetensors to `directory`, atomically."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".staging-"))
    save_file(tensors, str(staging / WEIGHTS_FILE))
    publish_directory(staging, directory)


def model_from_hf(
    config: Any, state_dict: Mapping[str, torch.Tensor], device: str | torch.device = "cpu",
    plan: ExecutionPlan | None = None,
) -> CausalLM:
    """Our model (its family found by the registry) holding the tensors of a HF `state_dict` (shared, not copied,
    when already on `device`), built with the execution `plan` (default: `plain_execution`, what a model built
    outside an engine runs). The state dict may already have fused projections (as our own saved weights do)."""
    with torch.device("meta"):
        model = build_model(config, plan or plain_execution(torch.device(device).type))
    scaled = next((name for name in state_dict if name.endswith(FP8_SCALE_SUFFIXES)), None)
    if scaled is not None:
        raise ValueError(f"the checkpoint stores block-scaled FP8 weights ({scaled}), as DeepSeek-V3/R1's official "
                         "ones do: not served; use a bfloat16 conversion of it")
    linears: dict[str, Any] = {}
    if is_quantized_checkpoint(state_dict):  # GPTQ/AWQ: their linears run their codes, never held as floats
        linears = checkpoint_linears(state_dict, checkpoint_quantization(config), model.spec)
        state_dict = without_code_tensors(state_dict)
    tensors = fuse_hf_state_dict(dict(state_dict), model.spec.hf_fusions, model.spec.hf_renames)
    install_checkpoint_linears(model, linears, tensors, checkpoint_method(config))
    if model.spec.prepare_weights is not None:
        tensors = model.spec.prepare_weights(tensors, config)
    if getattr(config, "tie_word_embeddings", False):
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    moved = {name: t.to(device) for name, t in tensors.items()}
    model.load_state_dict(moved, strict=True, assign=True)
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False)


def checkpoint_quantization(config: Any) -> dict[str, Any]:
    """A quantized checkpoint's `quantization_config` as a dict; {} for a float checkpoint."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    return dict(quantization or {})


def checkpoint_method(config: Any) -> str:
    """The method of a quantized checkpoint's `quantization_config` ("gptq", "awq"); "none" without one."""
    return str(checkpoint_quantization(config).get("quant_method") or "none").lower()


# config values a swapped-in checkpoint must share with the running model (beyond its tensors' shapes)
ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings",
                       "hidden_act")
MAX_LISTED_MISMATCHES = 5


class WeightMismatch(ValueError):
    """A checkpoint that does not fit the running model (another architecture or other tensor shapes)."""


@dataclass
class Checkpoint:
    """Weights read from disk for a swap: where from, their config, and our model's tensors (on the CPU)."""

    path: str
    config: Any
    tensors: dict[str, torch.Tensor]


def load_checkpoint(path: str, dtype: torch.dtype) -> Checkpoint:
    """Read the checkpoint at `path` (a .gguf file, a safetensors directory, or the packaged default) on the CPU,
    as our model's tensors (fused projections) in `dtype`. Raises FileNotFoundError or ValueError (an
    unsupported model) saying what is wrong."""
    model = load_model(resolve_model(path), dtype, "cpu")
    return Checkpoint(path, model.config, dict(model.state_dict()))


def _config_mismatches(running: Any, new: Any) -> list[str]:
    out = []
    for name in ARCHITECTURE_FIELDS:
        a, b = getattr(running, name, None), getattr(new, name, None)
        if a != b:
            out.append(f"config {name} is {b!r}, the running model's {a!r}")
    for name, read in (("head_dim", head_dim_of), ("rms_norm_eps", lambda c: float(c.rms_norm_eps))):
        a, b = read(running), read(new)
        if not math.isclose(a, b, rel_tol=1e-4):
            out.append(f"config {name} is {b!r}, the running model's {a!r}")
    rope = [getattr(c, "rope_parameters", None) or (getattr(c, "rope_theta", None), getattr(c, "rope_scaling", None))
            for c in (running, new)]
    if rope[0] != rope[1]:
        out.append(f"config rope_parameters are {rope[1]!r}, the running model's {rope[0]!r}")
    return out


def _quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    from ringserve.kernels.quantization import QuantLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def _expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must give, with its shape (a quantized layer's as the float weight it came from)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    for name, layer in _quantized_layers(model).items():
        shapes[f"{name}.weight"] = (layer.out_features, layer.in_features)
        if layer.bias is not None:
            shapes[f"{name}.bias"] = (layer.out_features,)
    return shapes


def weight_mismatches(model: CausalLM, checkpoint: Checkpoint) -> list[str]:
    """What keeps `checkpoint` from replacing `model`'s weights (empty: it fits)."""
    problems = _config_mismatches(model.config, checkpoint.config)
    expected = _expected_shapes(model)
    for name, shape in expected.items():
        tensor = checkpoint.tensors.get(name)
        if tensor is None:
            problems.append(f"tensor {name} is missing")
        elif tuple(tensor.shape) != shape:
            problems.append(f"tensor {name} has shape {list(tensor.shape)}, the running model's {list(shape)}")
    problems += [f"tensor {name} is not in the running model" for name in checkpoint.tensors if name not in expected]
    return problems


def swap_weights(model: CausalLM, checkpoint: Checkpoint, check_only: bool = False) -> None:
    """Copy `checkpoint`'s tensors into `model`'s in place (converted to their dtype and device); quantize the
    quantized layers again. Raises WeightMismatch, before changing anything, when the checkpoint does not fit or
    the running model runs a file's own codes (a GGUF's blocks, a GPTQ/AWQ checkpoint's 4-bit groups), which no
    float weights replace."""
    codes = next((m.method for m in _quantized_layers(model).values() if m.method in PACKED_METHODS), None)
    if codes is not None:
        raise WeightMismatch(f"the running model runs its {codes} checkpoint's own codes, which are not swapped "
                             f"for new weights: restart the server on {checkpoint.path}")
    problems = weight_mismatches(model, checkpoint)
    if problems:
        more = len(problems) - MAX_LISTED_MISMATCHES
        raise WeightMismatch(f"{checkpoint.path} does not have the running model's architecture: "
                             + "; ".join(problems[:MAX_LISTED_MISMATCHES]) + (f"; and {more} more" if more > 0 else ""))
    if check_only:
        return
    with torch.no_grad():
        for name, target in model.state_dict(keep_vars=True).items():
            target.copy_(checkpoint.tensors[name])
        for name, layer in _quantized_layers(model).items():
            _requantize(model, name, layer, checkpoint.tensors)
        _refresh_bf16_copies(model)


def _refresh_bf16_copies(model: nn.Module) -> None:
    """Bring the bfloat16 copies float linears keep beside their float32 weights (kernels/float_linear.py) up
    to the weights just copied in."""
    from ringserve.kernels.float_linear import FloatLinear

    for layer in model.modules():
        if isinstance(layer, FloatLinear):
            layer.refresh()


def _requantize(model: nn.Module, name: str, layer: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Replace quantized layer `name` by one quantized from the checkpoint's float weight: the same method and
    kernel plan."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    linear.weight = nn.Parameter(tensors[f"{name}.weight"].float(), requires_grad=False)
    if layer.bias is not None:
        linear.bias = nn.Parameter(tensors[f"{name}.bias"].float(), requires_grad=False)
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, type(layer)(linear, layer.method, layer.plan))
