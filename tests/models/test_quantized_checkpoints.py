"""Checkpoints that ship quantized (`quantization_config` in config.json): a method we do not serve is refused by
the launcher in one line naming it and what we serve, before any actor starts; `--quantization` on top of a
checkpoint already quantized is refused, saying why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from unittest.mock import patch

import httpx
import pytest
import torch

from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.models.weights import (
    WeightMismatch, load_checkpoint, load_model, model_from_hf, swap_weights,
)
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import TokenizedRequest
from ringserve.kernels.cpu.packed_weight import PackedWeight
from ringserve.kernels.cpu.packing_kbits import dequantize_kbits, pack_kbits
from ringserve.kernels.quantization import QuantLinear
from tests.checkpoint_formats import Quantized, quantization_config, write_quantized_checkpoint
from tests.engine_helpers import greedy, run_to_completion, tokens_of
from tests.model_families import CONFIGS, tiny_hf_model
from tests.server_helpers import save_tiny_model, server_info, start_server
from tests.launcher.test_docs_claims import ringserve_cmd

VOCAB = 49152  # SmolLM2's tokenizer
NEW_TOKENS = 12

UNSERVED = {"bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "hqq": {"quant_method": "hqq", "nbits": 4},
            "quanto": {"quant_method": "quanto", "weights": "int4"}}


@pytest.fixture(scope="module")
def float_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float Llama with SmolLM2's tokenizer, saved as a directory."""
    return save_tiny_model(tmp_path_factory.mktemp("float") / "llama", 256)


def with_quantization(source: Path, directory: Path, quantization: dict) -> Path:
    """A copy of the checkpoint `source` whose config.json carries `quantization` as its quantization_config
    (in place of any it has)."""
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("method", sorted(UNSERVED))
def test_an_unserved_quantization_is_refused_in_one_line(float_directory: Path, tmp_path: Path, method: str) -> None:
    """`ringserve serve` exits before any actor starts: after the progress line saying the model is being read,
    one line naming the checkpoint's method and what is served."""
    directory = with_quantization(float_directory, tmp_path / method, UNSERVED[method])
    done = ringserve_cmd("serve", "--model", str(directory), "--port", "1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "reading the model" in lines[0], done.stderr
    assert lines[1].startswith(f"ringserve: {directory} is quantized by {method!r}"), done.stderr
    assert "quantized checkpoints served:" in lines[1], done.stderr
    assert "started actor" not in done.stdout + done.stderr


def tiny_model(family: str) -> Any:
    """`family`'s tiny transformers model with 128 hidden and 256 intermediate features (so a group of 128 is
    four of our 32-groups; 4 heads of 32; experts of 64) and SmolLM2's vocabulary (so the real tokenizer serves
    it)."""
    base = CONFIGS[family]

    def wider() -> Any:
        config = base()
        config.update(dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, head_dim=32))
        if hasattr(config, "moe_intermediate_size"):
            config.moe_intermediate_size = 64
        return config

    with patch.dict(CONFIGS, {family: wider}):
        return tiny_hf_model(family)


# (family, method, group size, symmetric, desc_act)
CASES = [("llama3", "gptq", 128, True, False), ("qwen3", "gptq", 32, False, False), ("llama3", "awq", 64, False, False),
         ("qwen3", "awq", 128, False, False), ("qwen3", "gptq_v2", 64, False, False),
         ("llama3", "gptq", 64, False, True), ("qwen3", "gptq", 32, True, True),
         ("qwen3_moe", "gptq", 32, False, False)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, tuple[Path, Any, dict[str, Quantized]]]:
    """Each case's checkpoint directory (with SmolLM2's tokenizer), the float model holding the exact
    dequantization, and the codes written, by case."""
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))
    out = {}
    for case in CASES:
        family, method, group, sym, desc_act = case
        hf_model = tiny_model(family)
        directory = tmp_path_factory.mktemp(method) / f"{family}-{method}-{group}"
        codes = write_quantized_checkpoint(hf_model, directory, method, group, sym, desc_act)
        tokenizer.save_pretrained(directory)
        out[case] = (directory, hf_model, codes)
    return out


FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}


def our_name(hf_name: str) -> str:
    """Our linear an HF linear is (part of): q/k/v in qkv_proj, gate/up in gate_up_proj."""
    parent, _, child = hf_name.rpartition(".")
    return f"{parent}.{FUSED_INTO.get(child, child)}"


def fused_codes(codes: dict[str, Quantized], name: str) -> list[Quantized]:
    """The HF linears our linear `name` is made of (q/k/v for qkv_proj, gate/up for gate_up_proj), in row order."""
    parent, _, child = name.rpartition(".")
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(child, (child,))
    return [codes[f"{parent}.{part}"] for part in parts]


def engine_of(directory: Path) -> EngineCore:
    return EngineCore.from_source(resolve_model(str(directory)),
                                  EngineConfig(device="cpu", max_total_tokens=4096, torch_threads=1))


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_a_quantized_checkpoint_runs_its_own_codes(checkpoints: dict, case: tuple) -> None:
    """Loaded from the directory, every decoder linear is a layer of the checkpoint's method on our q4_k form
    whose weight is exactly the format's dequantization of its codes (fused q/k/v and gate/up row by row); the
    rest loads as floats; a quantized linear is made from its codes as it loads, and no float copy of it is
    ever held. Greedy tokens equal those of an
    in-process engine built from the float model holding those exact dequantized weights, its linears running
    q4_k on codes the test packs itself (our kernels quantize activations to int8 per block of 32, so the float
    model's own float32 matmuls are not an exact reference: on these models they part after about 8 tokens)."""
    directory, hf_model, codes = checkpoints[case]
    method = case[1].removesuffix("_v2")
    engine = engine_of(directory)
    layers = {n: m for n, m in engine.runner.model.named_modules() if isinstance(m, QuantLinear)}
    assert set(layers) == {our_name(name) for name in codes}, sorted(layers)
    loaded = load_model(resolve_model(str(directory)), torch.float32, "cpu")  # made from the codes as it loads
    assert {n for n, m in loaded.named_modules() if isinstance(m, QuantLinear)} == set(layers)
    assert engine.stats().quantization["method"] == method
    reference = model_from_hf(hf_model.config, hf_model.state_dict(), "cpu")
    for name, layer in layers.items():
        assert layer.method == method and set(layer.packed) == {"q4_k"} and layer.weight_f is None, name
        assert layer.kernel_for(1) == layer.kernel_for(512) == "q4_k", name
        exact = torch.cat([q.dequantize() for q in fused_codes(codes, name)])
        packed, order = pack_kbits_of(fused_codes(codes, name))
        assert (layer.input_order is None) == (order is None) == (not case[4]), name
        columns = order if order is not None else torch.arange(exact.shape[1])
        if order is not None:
            assert torch.equal(layer.input_order, order), name
        assert torch.equal(dequantize_kbits(layer.packed["q4_k"]), exact[:, columns]), name
        parent, _, child = name.rpartition(".")
        ref_parent = reference.get_submodule(parent)
        assert torch.equal(getattr(ref_parent, child).weight, exact), name
        setattr(ref_parent, child, QuantLinear(getattr(ref_parent, child), method, layer.plan, packed=packed,
                                               input_order=order))
    expected = EngineCore(reference, EngineConfig(device="cpu", max_total_tokens=4096, torch_threads=1))
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 40)]
    requests = [TokenizedRequest(f"r{i}", p, greedy(NEW_TOKENS)) for i, p in enumerate(prompts)]
    got, want = run_to_completion(engine, requests), run_to_completion(expected, requests)
    assert {r: tokens_of(rows) for r, rows in got.items()} == {r: tokens_of(rows) for r, rows in want.items()}
    shapes = {f"{m.in_features}->{m.out_features} any rows" for m in layers.values()}
    assert engine.stats().quantization == {"method": method, "isa": engine.stats().quantization["isa"],
                                           **{shape: "q4_k" for shape in shapes}}


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5], CASES[7]],
                         ids=["gptq", "awq", "gptq-desc_act", "gptq-experts"])
def test_a_quantized_checkpoint_is_served_through_the_ring(checkpoints: dict, case: tuple) -> None:
    """`ringserve serve` on the directory: `/generate`'s greedy tokens of batched prompts equal the in-process
    engine's on the same directory, and `/get_server_info` reports the checkpoint's method and each linear
    shape's kernel."""
    directory = checkpoints[case][0]
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 40)]
    requests = [TokenizedRequest(f"r{i}", p, greedy(NEW_TOKENS)) for i, p in enumerate(prompts)]
    want = [tokens_of(rows) for rows in run_to_completion(engine_of(directory), requests).values()]
    server = start_server(str(directory), extra=["--torch-threads", "1"])
    try:
        got = []
        for ids in prompts:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
            response = httpx.post(server.base_url + "/generate", json=body, timeout=300)
            assert response.status_code == 200, response.text
            got.append(response.json()["output_ids"])
        report = server_info(server.base_url)["quantization"]
    finally:
        server.stop()
    assert got == want
    assert report["method"] == case[1] and set(report.values()) - {case[1], report["isa"]} == {"q4_k"}, report


def pack_kbits_of(parts: list[Quantized]) -> tuple[PackedWeight, torch.Tensor | None]:
    """The linears `parts` (rows concatenated) as our q4_k form, from the test's own codes, and the order of the
    inputs its columns hold: desc_act's groups sorted (None: in order already)."""
    groups = parts[0].groups
    assert all(torch.equal(q.groups, groups) for q in parts)
    order = None if torch.equal(groups, groups.sort().values) else torch.sort(groups, stable=True).indices
    columns = order if order is not None else torch.arange(len(groups))
    codes = torch.cat([q.codes for q in parts]).to(torch.int16)[:, columns]
    scale = torch.cat([q.scales.float()[q.groups].t() for q in parts])[:, columns]  # [N, K] per input
    zero = torch.cat([q.zeros.float()[q.groups].t() for q in parts])[:, columns]
    scale32, min32 = scale[:, ::32], -(scale * zero)[:, ::32]
    packed = pack_kbits(codes, scale32.repeat_interleave(2, dim=1), min32, 4)
    assert packed is not None
    return packed, order


@pytest.mark.parametrize("flags, says", [
    (["--quantization", "int8"], "already quantized by 'gptq'"), (["--quantization", "int4"], "already quantized"),
    (["--quantization", "auto"], "already quantized"), (["--tp", "2"], "not split by rank"),
    (["--dtype", "bfloat16"], "float32 activations only"), (["--device", "cuda"], "float32 activations only")])
def test_flags_a_quantized_checkpoint_cannot_take_are_refused(checkpoints: dict, flags: list[str], says: str) -> None:
    """`--quantization` on top of a GPTQ checkpoint, `--tp`, a GPU or another dtype: refused in one line
    saying why, before any actor starts."""
    directory = checkpoints[CASES[0]][0]
    done = ringserve_cmd("serve", "--model", str(directory), "--port", "1", *flags)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and says in lines[1], done.stderr


@pytest.mark.parametrize("change", [{"bits": 8}, {"bits": 3}, {"group_size": 48},
                                    {"checkpoint_format": "marlin"}, {"zero_point": False}, {"version": "gemv"}])
def test_an_unserved_variant_is_refused(checkpoints: dict, tmp_path: Path, change: dict) -> None:
    """A GPTQ or AWQ checkpoint of a variant we do not serve: refused in one line naming it and what is served."""
    source = checkpoints[CASES[0]][0]
    method = "awq" if "zero_point" in change or "version" in change else "gptq"
    quantization = {**quantization_config(method, 128, True), **change}
    directory = with_quantization(source, tmp_path / "variant", quantization)
    done = ringserve_cmd("serve", "--model", str(directory), "--port", "1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and f"is a {method} checkpoint with" in lines[1] and "served are" in lines[1], done.stderr


def test_a_quantized_checkpoint_s_weights_are_not_swapped(checkpoints: dict) -> None:
    """A running GPTQ model's layers are its file's codes: new float weights are refused before anything
    changes, saying to restart on them."""
    directory = checkpoints[CASES[0]][0]
    engine = engine_of(directory)
    model = engine.runner.model
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(WeightMismatch, match="runs its gptq checkpoint's own codes, which are not swapped"):
        swap_weights(model, load_checkpoint(str(directory), torch.float32))
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


def test_codes_without_a_quantization_config_are_refused(checkpoints: dict, tmp_path: Path) -> None:
    """An older AutoGPTQ directory (quantize_config.json, no quantization_config in config.json): refused in one
    line saying what to do, not loaded as a float checkpoint it is not."""
    directory = tmp_path / "autogptq"
    shutil.copytree(checkpoints[CASES[0]][0], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (directory / "config.json").write_text(json.dumps(config))
    done = ringserve_cmd("serve", "--model", str(directory), "--port", "1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "quantize_config.json (AutoGPTQ's) but no quantization_config" in lines[1], done.stderr


def test_codes_in_another_layout_than_named_are_refused(checkpoints: dict, tmp_path: Path) -> None:
    """AWQ's tensors under a config that says GPTQ: the load stops naming the linear and the mismatch, rather
    than serving misread codes."""
    source = checkpoints[CASES[2]][0]
    directory = with_quantization(source, tmp_path / "mislabelled", quantization_config("gptq", 64, False))
    with pytest.raises(ValueError, match="not the layout its quant_method names"):
        engine_of(directory)
