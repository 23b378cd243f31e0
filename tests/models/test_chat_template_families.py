"""The families' own chat templates (tests/chat_templates/: Gemma 2 and 3, Llama 3, Mistral v3 with tools, Phi-3,
Qwen 2.5 with tools, as their checkpoints carry them) rendered as transformers renders them; a template that
refuses a conversation (Gemma 2's "System role not supported") is the client's 400, through the prompt encoder
and through a whole ring; a GGUF's `tokenizer.chat_template` is the one the tokenizer renders; and where a GGUF
has none (the real Gemma 3 270M file) the Gemma fallback puts a system message where Gemma 3's template does."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.common.chat_template import render_chat
from ringserve.actors.common.model_source import (DEFAULT_MODEL, ModelSource, load_tokenizer, model_chat_template,
                                                  resolve_model)
from ringserve.actors.common.text_tokenizer import load_text_model
from ringserve.actors.common.fallback_templates import fallback_template
from ringserve.actors.entry.tool_parsers import parser_for_template
from ringserve.actors.tokenizer.prompt import PromptEncoder
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import ChatMessage, GenerateRequest
from tests.server_helpers import ServerHandle, server_info, start_server

TEMPLATES = Path(__file__).parent.parent / "chat_templates"
FAMILIES = sorted(path.stem for path in TEMPLATES.glob("*.jinja"))
SYSTEM, USER = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}
CALL_ID = "a1b2c3d4e"  # Mistral's templates take 9-character ids
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CHATS = {
    "user": [USER],
    "system": [SYSTEM, USER],
    "turns": [SYSTEM, USER, {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "2+2?"}],
    "parts": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, USER],
    "tool round trip": [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny"}],
    "not alternating": [USER, USER],
}
GEMMA3_SYSTEM_PROMPT = "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def family_template(family: str) -> str:
    """The family's own chat template, as its checkpoint's chat_template.jinja holds it."""
    return (TEMPLATES / f"{family}.jinja").read_text()


def rendered(render: Any) -> str:
    """What a render gives: its text, or "refused" if the template raised."""
    try:
        return str(render())
    except Exception:  # noqa: BLE001 - a template raises what it likes; both sides must refuse alike
        return "refused"


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    """transformers' SmolLM2 tokenizer: the reference renderer (its special tokens fill the templates' names)."""
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def text_tokenizer() -> Any:
    """The exported SmolLM2 tokenizer the tokenizer actor serves."""
    return load_text_model(resolve_model(DEFAULT_MODEL)).tokenizer


def encoder_with(tokenizer: Any, template: str) -> PromptEncoder:
    """The tokenizer actor's prompt encoder over `tokenizer` with `template` as its chat template."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return PromptEncoder(tokenizer)


def chat_request(*turns: dict[str, str]) -> GenerateRequest:
    """A chat request of plain text turns, with the generation prompt."""
    return GenerateRequest(rid="r", messages=[ChatMessage(role=t["role"], content=t["content"]) for t in turns],
                           add_generation_prompt=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_familys_template_renders_as_transformers_does(family: str, hf_tokenizer: Any) -> None:
    template = family_template(family)
    variables = dict(hf_tokenizer.special_tokens_map)
    results = {}
    for name, chat in CHATS.items():
        for tools in (None, TOOLS):
            expected = rendered(lambda: hf_tokenizer.apply_chat_template(
                chat, chat_template=template, tools=tools, tokenize=False, add_generation_prompt=True))
            got = rendered(lambda: render_chat(template, chat, tools=tools, add_generation_prompt=True,
                                               variables=variables))
            assert got == expected, (family, name, tools)
            results[name, tools is not None] = got
    assert results["user", False] != "refused"
    if "tools" in template:  # the tool definitions reach the prompt
        assert "get_weather" in results["user", True] and "get_weather" not in results["user", False]


def test_the_tool_call_parser_follows_the_whole_templates() -> None:
    """`--tool-call-parser auto` on the full templates: Mistral's writes [TOOL_CALLS], Qwen's asks for <tool_call>,
    the others name no format (hermes, the default tool prompt's)."""
    chosen = {family: parser_for_template(family_template(family)) for family in FAMILIES}
    assert chosen == {family: "mistral" if family == "mistral_v3" else "hermes" for family in FAMILIES}


def test_gemma2_refuses_a_system_message_and_gemma3_folds_it_into_the_first_turn() -> None:
    variables = {"bos_token": "<bos>"}
    assert rendered(lambda: render_chat(family_template("gemma2"), CHATS["system"], variables=variables)) == "refused"
    assert render_chat(family_template("gemma3"), CHATS["system"], add_generation_prompt=True,
                       variables=variables) == GEMMA3_SYSTEM_PROMPT


def test_a_refusing_template_is_the_clients_400(text_tokenizer: Any) -> None:
    encoder = encoder_with(text_tokenizer, family_template("gemma2"))
    with pytest.raises(ApiError) as refused:
        encoder.encode(chat_request(SYSTEM, USER))
    assert refused.value.code == 400 and refused.value.param == "messages"
    assert "System role not supported" in refused.value.message
    ids = encoder.encode(chat_request(USER))
    assert text_tokenizer.decode(ids) == f"{text_tokenizer.special_tokens_map['bos_token']}<start_of_turn>user\nHi<end_of_turn>\n" \
                                         "<start_of_turn>model\n"


@pytest.mark.parametrize("chat", ["user", "system", "turns", "parts", "not alternating"])
def test_the_gemma_fallback_renders_as_gemma3s_own_template(chat: str) -> None:
    """GGUF files without a template (the real Gemma 3 270M) get actors/common/fallback_templates.py's."""
    fallback = fallback_template("gemma3")
    assert fallback is not None
    for generation in (True, False):
        ours, gemma3 = (rendered(lambda t=t: render_chat(t, CHATS[chat], add_generation_prompt=generation,
                                                           variables={"bos_token": "<bos>"}))
                        for t in (fallback, family_template("gemma3")))
        assert ours == gemma3, (chat, generation)


def test_the_real_gemma3_gguf_renders_a_system_message_as_gemma3_does() -> None:
    from tests.real_models import gemma3_gguf

    source = resolve_model(str(gemma3_gguf()))
    assert model_chat_template(source) == fallback_template("gemma3")  # the file carries no template
    tokenizer = load_text_model(source).tokenizer
    assert tokenizer.apply_chat_template([SYSTEM, USER], add_generation_prompt=True) == GEMMA3_SYSTEM_PROMPT
    ids = PromptEncoder(tokenizer).encode(chat_request(SYSTEM, USER))
    assert tokenizer.decode(ids) == GEMMA3_SYSTEM_PROMPT
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.convert_tokens_to_ids("<start_of_turn>")) == 2


def write_tiny_gguf(path: Path, chat_template: str) -> None:
    """A GGUF holding only metadata: a tiny Llama config, a SentencePiece-style vocabulary (byte pieces and a few
    words) and `tokenizer.chat_template`, as llama.cpp's converter writes them."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_block_count(1)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(8)
    writer.add_layer_norm_rms_eps(1e-5)
    words = ["▁", "▁Hi", "▁Be", "▁brief", "H", "i", "B", "e", "."]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *words]
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * (3 + 256) + [-float(i) for i in range(len(words))])
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
                            *[gguf.TokenType.BYTE] * 256, *[gguf.TokenType.NORMAL] * len(words)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def test_a_ggufs_own_template_is_the_one_rendered(tmp_path: Path, plan_dir: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", family_template("gemma2"))
    source = resolve_model(str(tmp_path / "tiny.gguf"))
    assert source == ModelSource(str(tmp_path), "tiny.gguf", "tiny")
    assert model_chat_template(source) == family_template("gemma2")  # what picks the tool-call parser
    tokenizer = load_text_model(source).tokenizer  # what the tokenizer actor renders with
    encoder = PromptEncoder(tokenizer)
    assert tokenizer.decode(encoder.encode(chat_request(USER))) == \
        "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ApiError, match="System role not supported"):
        encoder.encode(chat_request(SYSTEM, USER))


@pytest.fixture(scope="module")
def gemma2_template_ring(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """A whole ring serving the tiny model with Gemma 2's chat template as its own."""
    directory = tmp_path_factory.mktemp("gemma2-template") / "model"  # served as "model"
    shutil.copytree(tiny_model_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(family_template("gemma2"))
    handle = start_server(str(directory), extra=["--max-total-tokens", "512"])
    yield handle
    handle.stop()


def test_a_ring_answers_a_refused_system_message_with_a_400(gemma2_template_ring: ServerHandle) -> None:
    url = gemma2_template_ring.base_url
    body: dict[str, Any] = {"model": "model", "max_tokens": 2, "messages": [SYSTEM, USER]}
    refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "System role not supported" in error["message"] and error["param"] == "messages"
    served = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": [USER]}, timeout=60)
    assert served.status_code == 200, served.text
    assert server_info(url)["tool_call_parser"] == "hermes"  # Gemma's template names no tool format


def test_tools_with_a_template_that_refuses_a_system_role(text_tokenizer: Any) -> None:
    """Gemma 2's template reads no tools and refuses a system role: the default tool prompt opens the first user
    turn instead of a system message of its own."""
    encoder = encoder_with(text_tokenizer, family_template("gemma2"))
    request = chat_request(USER)
    request.tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = text_tokenizer.decode(encoder.encode(request))
    assert text.startswith(f"{text_tokenizer.special_tokens_map['bos_token']}<start_of_turn>user\n")
    assert "get_weather" in text and text.rstrip().endswith("Hi<end_of_turn>\n<start_of_turn>model")
