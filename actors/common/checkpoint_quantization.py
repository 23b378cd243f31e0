"""What a checkpoint says of its own quantization (`quantization_config` in config.json), read without torch, so
the launcher refuses one we do not serve before any actor starts, in one line that names its method (or the
variant of a served one: bits, layout, group size, zero points) and what we serve; and the flags a quantized
checkpoint cannot take (`--quantization` on top of it, `--tp`, a GPU or another dtype), saying why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The methods whose codes the engine reads at load and keeps (kernels/cpu/checkpoint_codes.py).
SERVED_METHODS: tuple[str, ...] = ("gptq", "awq")
OWN_CONFIG_FILE = "quantize_config.json"  # where older AutoGPTQ checkpoints keep their settings instead


class UnservedQuantization(ValueError):
    """A checkpoint quantized in a way we do not serve, or a quantization flag it cannot take; says why."""


def checkpoint_quantization(directory: str | Path) -> dict[str, Any] | None:
    """The `quantization_config` of the model directory `directory`'s config.json; None when it has none (a
    float checkpoint) or no readable config.json."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return quantization if isinstance(quantization, dict) else None


def quant_method(quantization: dict[str, Any]) -> str:
    """The method a `quantization_config` names (`quant_method`, lower case; "unnamed" when it names none)."""
    return str(quantization.get("quant_method") or "unnamed").lower()


def check_checkpoint_quantization(directory: str | Path, requested: str, tp: int = 1, device: str = "auto",
                                  dtype: str = "auto") -> None:
    """Raise UnservedQuantization when the checkpoint in `directory` is quantized by a method we do not serve (or
    a variant of it: `unserved_variant`), when `requested` (`--quantization`) would quantize a checkpoint that
    already is, when `tp` would split its codes across ranks, or when `device`/`dtype` (`--device`, `--dtype`)
    name other than a CPU in float32, where its codes run (auto resolves in the engine, which refuses a GPU)."""
    quantization = checkpoint_quantization(directory)
    if quantization is None:
        if (Path(directory) / OWN_CONFIG_FILE).is_file():
            raise UnservedQuantization(
                f"{directory} has {OWN_CONFIG_FILE} (AutoGPTQ's) but no quantization_config in config.json: not "
                "read; copy its settings into config.json's quantization_config with quant_method gptq")
        return
    method = quant_method(quantization)
    if method not in SERVED_METHODS:
        served = ", ".join(SERVED_METHODS)
        raise UnservedQuantization(
            f"{directory} is quantized by {method!r} (quantization_config.quant_method): not served; quantized "
            f"checkpoints served: {served}; serve the model's float checkpoint (--quantization int8/int4 "
            "quantizes it here)")
    variant = unserved_variant(quantization)
    if variant is not None:
        raise UnservedQuantization(f"{directory} is a {method} checkpoint with {variant}: not served; served are "
                                   f"{SERVED_VARIANTS}")
    if requested != "none":
        raise UnservedQuantization(
            f"--quantization {requested} on {directory}, a checkpoint already quantized by {method!r}: its own codes "
            "are served as they are, never quantized again; leave --quantization out")
    if tp > 1:
        raise UnservedQuantization(f"--tp {tp} on {directory}, a {method} checkpoint: its packed codes are not split "
                                   "by rank; serve it with --tp 1")
    if device not in ("auto", "cpu") or dtype not in ("auto", "float32"):
        raise UnservedQuantization(f"--device {device} --dtype {dtype} on {directory}, a {method} checkpoint: its "
                                   "4-bit codes run in our CPU kernels with float32 activations only (--device cpu, "
                                   "--dtype float32)")


SERVED_VARIANTS = ("4-bit GPTQ (gptq or gptq_v2 layout, sym or asym, desc_act or not, a group size a multiple of 32 "
                   "or -1) and 4-bit AWQ (GEMM layout with zero points, a group size a multiple of 32)")


def unserved_variant(quantization: dict[str, Any]) -> str | None:
    """What of a served method's `quantization_config` we do not serve (bits, layout, group size, zero points), in
    words; None when all of it is served."""
    method = quant_method(quantization)
    bits = quantization.get("bits", quantization.get("w_bit"))
    if bits != 4:
        return f"bits {bits}"
    group = quantization.get("group_size", quantization.get("q_group_size"))
    whole_rows = group == -1 and method == "gptq"  # one group per output row
    if not isinstance(group, int) or not whole_rows and (group <= 0 or group % 32):
        return f"group_size {group}"
    if method == "gptq":
        layout = quantization.get("checkpoint_format") or "gptq"
        if layout not in ("gptq", "gptq_v2"):
            return f"checkpoint_format {layout!r}"
    if method == "awq":
        version = str(quantization.get("version") or "gemm").lower()
        if version != "gemm":
            return f"version {version!r}"
        if quantization.get("zero_point") is False:
            return "zero_point false"
    return None
