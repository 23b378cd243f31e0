"""The second real model: Gemma 3 270M from its Q4_K_M GGUF, greedy token for token against transformers reading
the same file, in the engine and through the whole ring (chat completions with Gemma's own template); and served
on the file's own blocks (`--quantization gguf`: Q5_0, Q8_0, and the K-quants Q4_K and Q6_K), which are exactly
the weights transformers dequantizes."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from ringserve.actors.common.model_source import load_tokenizer, resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import assert_greedy_matches, greedy, hf_greedy, load_hf_model, run_to_completion, tokens_of
from tests.real_models import gemma3_gguf
from tests.server_helpers import ServerHandle, start_server

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
QUESTION = [{"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="module")
def source() -> Any:
    return resolve_model(str(gemma3_gguf()))


@pytest.fixture(scope="module")
def tokenizer(source: Any) -> Any:
    return load_tokenizer(source)


@pytest.fixture(scope="module")
def gemma_hf(source: Any) -> Any:
    return load_hf_model(source)


@pytest.fixture(scope="module")
def engine(source: Any) -> EngineCore:
    return EngineCore.from_source(source, EngineConfig(device="cpu", torch_threads=1, max_total_tokens=8192))


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_greedy_tokens_equal_transformers_reading_the_same_file(engine: EngineCore, gemma_hf: Any,
                                                                 tokenizer: Any) -> None:
    """A plain prompt and a chat prompt in one batch, then a prompt past Gemma 3's 512-token sliding window."""
    prompts = {"plain": tokenizer("The capital of France is Paris. The capital of Germany is")["input_ids"],
               "chat": chat_ids(tokenizer, QUESTION),
               "long": tokenizer(" ".join(f"item {i} is {i * 7 % 13};" for i in range(120)))["input_ids"]}
    assert len(prompts["long"]) > 600
    rows = run_to_completion(engine, [TokenizedRequest(rid, ids, greedy(NEW_TOKENS)) for rid, ids in prompts.items()])
    for rid, ids in prompts.items():
        assert_greedy_matches(gemma_hf, ids, hf_greedy(gemma_hf, ids, NEW_TOKENS, None), tokens_of(rows[rid]))


def test_the_files_blocks_are_exactly_its_weights(source: Any, engine: EngineCore) -> None:
    """Every linear's packed blocks (each shape in the smallest exact form: the K-quants' 4-6 bit forms, Q5_0 and
    Q8_0 parts fused as q8_0) dequantize to the float weights transformers read from the same file."""
    from ringserve.actors.engine.models.gguf_blocks import packed_linears
    from ringserve.kernels.cpu.packing import dequantize

    model = engine.runner.model
    packed = packed_linears(str(gemma3_gguf()), model.num_layers, tied_head=True)
    assert len(packed) == 4 * model.num_layers + 1
    assert {p.format for p in packed.values()} <= {"q8_0", "q4_k", "q5_k", "q6_k", "q8_k"}
    assert packed["model.layers.0.mlp.down_proj"].format in ("q6_k", "q8_k")  # the file's Q6_K
    for name, p in packed.items():
        assert torch.equal(dequantize(p), model.get_submodule(name).weight), name


def test_served_on_its_own_blocks(source: Any, tokenizer: Any) -> None:
    """`--quantization gguf`: every linear runs the file's blocks in our kernels; the plain prompt's greedy
    continuation is the float32 one (activations quantized per block of 32, as llama.cpp does, move logits
    by little: this prompt has no near-tie)."""
    from ringserve.kernels.quantization import QuantLinear

    gguf_engine = EngineCore.from_source(source, EngineConfig(device="cpu", torch_threads=1, max_total_tokens=4096,
                                                          quantization="gguf"))
    layers = [m for m in gguf_engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 18 + 1 and all(layer.packed for layer in layers)
    ids = tokenizer("The capital of France is Paris. The capital of Germany is")["input_ids"]
    got = tokens_of(run_to_completion(gguf_engine, [TokenizedRequest("q", ids, greedy(NEW_TOKENS))])["q"])
    assert tokenizer.decode(got).startswith(" Berlin. The capital of the United States is Washington")


@pytest.fixture(scope="module")
def gemma_server() -> Iterator[ServerHandle]:
    handle = start_server(str(gemma3_gguf()))
    yield handle
    handle.stop()


def test_the_ring_answers_with_transformers_tokens(gemma_server: ServerHandle, gemma_hf: Any,
                                                   tokenizer: Any) -> None:
    """`/generate` on the chat prompt's ids gives transformers' greedy ids; the chat route, rendering Gemma's own
    template from the GGUF, gives their text."""
    import httpx

    ids = chat_ids(tokenizer, QUESTION)
    expected = hf_greedy(gemma_hf, ids, NEW_TOKENS, tokenizer.eos_token_id)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
    response = httpx.post(gemma_server.base_url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    assert_greedy_matches(gemma_hf, ids, expected, response.json()["output_ids"])
    body = {"messages": QUESTION, "max_tokens": NEW_TOKENS, "temperature": 0}
    reply = httpx.post(gemma_server.base_url + "/v1/chat/completions", json=body, timeout=300).json()
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
