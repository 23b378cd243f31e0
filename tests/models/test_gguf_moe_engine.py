"""Mixture-of-experts GGUF files served end to end: a tiny Qwen2-MoE and Qwen3-MoE written as llama.cpp lays them
out (experts stacked per projection, `ffn_gate_exps` `[E, rows, cols]`; the shared expert's `ffn_*_shexp`; the
router `ffn_gate_inp` and the shared expert's gate `ffn_gate_inp_shexp` as F32; a vocabulary), in the block types
llama.cpp files mix (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, and Q4_K down projections), read back by transformers as the
reference.

The float load gives transformers' greedy tokens; `--quantization gguf` runs every expert's linears as
`QuantLinear`s packed from exactly its slice of the file's blocks (its bytes packed again here, independently of
gguf_blocks.py, and dequantizing bit for bit to gguf-py's dequantization), and gives transformers' greedy tokens
up to a near-tie of its logits (our kernels quantize activations per block of 32, as llama.cpp does).

transformers reads neither `expert_feed_forward_length` nor `expert_shared_feed_forward_length` from a GGUF (it
keeps its config defaults) and maps no dense `ffn_gate` for these architectures (llama.cpp has none there), so the
files use the defaults' expert sizes and no dense layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import TokenizedRequest
from ringserve.kernels.cpu.gguf_formats import (
    BLOCK_BYTES, SCALE_OFFSETS, concat_rows, decode_gguf_blocks, pack_block_codes, random_gguf_blocks,
)
from ringserve.kernels.cpu.packing import dequantize
from ringserve.kernels.quantization import QuantLinear
from tests.engine_helpers import greedy, hf_greedy, load_hf_model, run_to_completion, tokens_of
from tests.model_families import CONFIGS

T = gguf.GGMLQuantizationType
ARCHITECTURES = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# transformers' defaults (the sizes a GGUF of these architectures loads with)
EXPERT_SIZES = {"qwen2_moe": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
                "qwen3_moe": dict(moe_intermediate_size=768)}
TYPES = {"qwen2_moe": {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q5_0, "ffn_down_exps": T.Q4_1,
                       "ffn_gate_shexp": T.Q8_0, "ffn_up_shexp": T.Q4_0, "ffn_down_shexp": T.Q5_1},
         "qwen3_moe": {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q4_1, "ffn_down_exps": T.Q4_K}}
# the packed form each linear of those types runs (kernels/cpu/gguf_formats.py: the fewest bytes holding every
# weight of a shape exactly): Q8_0 beside Q5_0 as q8_0 (both int8 codes per 32), Q8_0 beside Q4_0 as q8_k, Q4_0
# beside Q4_1 and Q5_1 as q5_k
FORMATS = {"qwen2_moe": {"experts.gate_up_proj": "q8_0", "experts.down_proj": "q4_1",
                         "shared_expert.gate_up_proj": "q8_k", "shared_expert.down_proj": "q5_k"},
           "qwen3_moe": {"experts.gate_up_proj": "q5_k", "experts.down_proj": "q4_k"}}
LLAMA_CPP = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
             "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
WEIGHT_STD = 0.15  # ~1/sqrt(hidden size); at 0.3 a 0.5% change of every linear moved the logits by ~0.5
K_SCALE = 0.05  # random K-quant blocks' scales (std 0.01) times this: weights of std ~0.03 (fan-in 768)
NEW_TOKENS = 12
PROMPTS = {"short": [5, 80, 120, 33, 7], "long": [1, 200, 13, 44, 91, 17, 3, 250, 66, 140, 9]}
# Our quantized kernels quantize activations per block of 32 (as llama.cpp does), changing each linear's output by
# ~0.5%; noise of that size on every linear moves this model's logits (std ~1.2) by up to ~0.2. The quantized
# engine may take another token only where transformers' best logits lie within this of each other (and the
# sequences fork there)
NEAR_TIE = 0.3


def tiny_moe_model(family: str) -> Any:
    """The family's tiny model (tests/model_families.py) with the expert sizes a GGUF loads with, every layer
    sparse, the vocabulary `TOKENS`, and every expert active for every token (weighted by the router's softmax):
    each expert's blocks count in every output, and no expert choice can flip (a random router's k-th and
    (k+1)-th experts often score within the quantized kernels' error of each other, and such a swap changes
    everything after it)."""
    from transformers import AutoModelForCausalLM

    config = CONFIGS[family]()
    for name, value in {**EXPERT_SIZES[family], "mlp_only_layers": [], "vocab_size": len(TOKENS),
                        "num_experts_per_tok": config.num_experts}.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            else:
                p.normal_(0.0, WEIGHT_STD)
    return model.eval()


def gguf_tensors(family: str, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """llama.cpp's tensors (name -> value) for one of transformers' tensors: stacked experts split into gate and
    up, the shared expert's gate a vector."""
    prefix, rest = "", name
    if name.startswith("model.layers."):
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        prefix = f"blk.{layer}."
    if rest == "mlp.experts.gate_up_proj":
        gate, up = tensor.chunk(2, dim=1)
        return {f"{prefix}ffn_gate_exps.weight": gate, f"{prefix}ffn_up_exps.weight": up}
    if rest == "mlp.experts.down_proj":
        return {f"{prefix}ffn_down_exps.weight": tensor}
    module, kind = rest.rsplit(".", 1)
    return {f"{prefix}{LLAMA_CPP[module]}.{kind}": tensor.reshape(-1) if module.endswith("_gate") else tensor}


def ggml_type(family: str, name: str) -> Any:
    """The block type the file stores tensor `name` in (None: F32, as llama.cpp keeps vectors and routers)."""
    part = name.split(".")[-2]
    if part in ("attn_q", "attn_k", "attn_v", "attn_output", "output") and name.endswith(".weight"):
        return T.Q8_0
    return TYPES[family].get(part)


def random_k_blocks(ggml_type: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random valid K-quant blocks of a tensor of `shape` (gguf-py quantizes to no K-quant: the file's weights
    are whatever its blocks say, and transformers reads the same ones), their fp16 scales made small enough that
    the weights spread about as wide as the model's other weights of that fan-in."""
    rows = int(np.prod(shape[:-1]))
    blocks = random_gguf_blocks(ggml_type, rows, shape[-1], seed).reshape(-1, BLOCK_BYTES[ggml_type])
    for offset in SCALE_OFFSETS[ggml_type]:
        scales = blocks[:, offset:offset + 2].copy().view(np.float16) * np.float16(K_SCALE)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def write_moe_gguf(family: str, model: Any, path: Path) -> None:
    """`model` as a GGUF of llama.cpp's layout (a K-quant tensor: `random_k_blocks`)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), ARCHITECTURES[family])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * len(TOKENS))
    writer.add_token_types([gguf.TokenType.UNKNOWN, *[gguf.TokenType.CONTROL] * 2, *[gguf.TokenType.BYTE] * 256])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for seed, (hf_name, hf_tensor) in enumerate(model.state_dict().items()):
        for name, tensor in gguf_tensors(family, hf_name, hf_tensor).items():
            kind = ggml_type(family, name)
            values = tensor.detach().float().contiguous().numpy()
            if kind is None:
                writer.add_tensor(name, values)
                continue
            if kind == T.Q4_K:
                raw = random_k_blocks(kind.name, values.shape, seed)
            else:
                raw = gguf.quants.quantize(values, kind)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def moe_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """(family, its GGUF's ModelSource), converted weights and kernel plans in a cache of the module's own."""
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    write_moe_gguf(family, tiny_moe_model(family), directory / "tiny.gguf")
    cpu_kernels.linear()  # loaded from the usual cache before it moves (a build in the new one takes minutes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RINGSERVE_CACHE", str(directory / "cache"))
        yield family, resolve_model(str(directory / "tiny.gguf"))


@pytest.fixture(scope="module")
def reference(moe_gguf: tuple[str, Any]) -> Any:
    """transformers' model read from the same file (it dequantizes every block)."""
    return load_hf_model(moe_gguf[1])


def serve(source: Any, method: str) -> tuple[EngineCore, dict[str, list[int]]]:
    """An engine on `source` with `--quantization method`, and its greedy tokens for `PROMPTS` in one batch."""
    engine = EngineCore.from_source(source, EngineConfig(device="cpu", torch_threads=1, max_total_tokens=2048,
                                                     quantization=method))
    rows = run_to_completion(engine, [TokenizedRequest(rid, ids, greedy(NEW_TOKENS)) for rid, ids in PROMPTS.items()])
    return engine, {rid: tokens_of(rows[rid]) for rid in PROMPTS}


def test_the_float_load_gives_transformers_greedy_tokens(moe_gguf: tuple[str, Any], reference: Any) -> None:
    _, source = moe_gguf
    _, got = serve(source, "none")
    for rid, ids in PROMPTS.items():
        assert got[rid] == hf_greedy(reference, ids, NEW_TOKENS, None), rid


def stacked_slice(reader: Any, name: str, expert: int | None) -> tuple[np.ndarray, str, int, int]:
    """The raw blocks of tensor `name` (of `expert`'s slice when stacked), its type, rows and columns."""
    tensor = next(t for t in reader.tensors if t.name == name)
    cols, rows = int(tensor.shape[0]), int(tensor.shape[1])
    data = np.asarray(tensor.data)
    return (data if expert is None else data.reshape(int(tensor.shape[2]), -1)[expert]), tensor.tensor_type.name, \
        rows, cols


def file_weight(reader: Any, parts: list[str], expert: int | None, fmt: str) -> tuple[Any, torch.Tensor]:
    """Our fused linear from the file's tensors `parts`: their blocks packed in `fmt`, and gguf-py's
    dequantization of the same bytes."""
    slices = [stacked_slice(reader, name, expert) for name in parts]
    packed = pack_block_codes(concat_rows([decode_gguf_blocks(raw, kind, rows, cols)
                                           for raw, kind, rows, cols in slices]), fmt)
    weight = torch.cat([torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).reshape(rows, cols))
                        for raw, kind, rows, cols in slices])
    return packed, weight


def test_served_on_each_experts_slice_of_the_files_blocks(moe_gguf: tuple[str, Any], reference: Any) -> None:
    family, source = moe_gguf
    engine, got = serve(source, "gguf")
    model = engine.runner.model
    config = reference.config
    reader = gguf.GGUFReader(str(Path(source.directory) / source.gguf_file))
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    linears = ["mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj"] if family == "qwen2_moe" else []
    linears += [f"mlp.experts.{e}.{p}" for e in range(config.num_experts) for p in ("gate_up_proj", "down_proj")]
    assert len(quantized) == config.num_hidden_layers * (2 + len(linears)) + 1  # attention, experts, LM head
    for i in range(config.num_hidden_layers):
        block = f"blk.{i}."
        for linear in linears:
            layer = quantized[f"model.layers.{i}.{linear}"]
            expert = int(linear.split(".")[2]) if ".experts." in linear else None
            part = ("_exps" if expert is not None else "_shexp") + ".weight"
            names = ["ffn_down"] if linear.endswith("down_proj") else ["ffn_gate", "ffn_up"]
            ours = layer.packed[layer.default]
            want, weight = file_weight(reader, [block + n + part for n in names], expert, ours.format)
            kind = linear.removeprefix("mlp.").replace(f".{expert}.", ".")
            assert layer.method == "gguf" and ours.format == layer.default == FORMATS[family][kind], (i, linear)
            for field in ("qweight", "scales", "mins", "wsums"):
                a, b = getattr(ours, field), getattr(want, field)
                assert (a is None and b is None) or torch.equal(a, b), (i, linear, field)
            assert torch.equal(dequantize(ours), weight), (i, linear)
        router, _, _, _ = stacked_slice(reader, block + "ffn_gate_inp.weight", None)
        assert torch.equal(model.model.layers[i].mlp.gate.weight, torch.from_numpy(np.array(router)))  # F32
    for rid, ids in PROMPTS.items():
        assert_follows_up_to_a_near_tie(reference, ids, hf_greedy(reference, ids, NEW_TOKENS, None), got[rid])


@torch.no_grad()
def assert_follows_up_to_a_near_tie(hf_model: Any, prompt: list[int], expected: list[int], got: list[int]) -> None:
    """`got` is transformers' greedy `expected` up to their first difference, where transformers' logit of `got`'s
    token is within `NEAR_TIE` of its best (the sequences fork there: nothing after is compared)."""
    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if i is None:
        assert len(got) == len(expected)
        return
    logits = hf_model(torch.tensor([prompt + expected[:i]])).logits[0, -1].float()
    gap = float(logits.max() - logits[got[i]])
    assert gap < NEAR_TIE, (f"position {i}: took {got[i]}, {gap:.3g} below transformers' {expected[i]}\n"
                            f"expected {expected}\ngot      {got}")
