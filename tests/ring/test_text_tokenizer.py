"""The tokenizer export the tokenizer and detokenizer actors load without transformers: the same ids, text and
chat prompts as transformers' tokenizer of the same model, no torch imported, and transformers' own tokenizer
where the export cannot reproduce it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ringserve.actors.common.chat_template import TemplateRejected, render_chat
from ringserve.actors.common.model_source import DEFAULT_MODEL, ModelSource, load_tokenizer, resolve_model
from ringserve.actors.common.text_tokenizer import TextTokenizer, load_text_model, transformers_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["", "Hello world", " x", "a  b   c\t\td\n\ne", "naïve café — “quotes” …", "日本語のテキスト", "🤖🧠 emoji",
         "<|im_start|>user\nhi<|im_end|>", "<|im_start|><|im_end|><|endoftext|>", "```python\nprint(1)\n```",
         "x" * 300, "\u200b zero width", "tail space "]


@pytest.fixture(scope="module")
def pair() -> tuple[Any, TextTokenizer]:
    source = resolve_model(DEFAULT_MODEL)
    ours = load_text_model(source).tokenizer
    assert isinstance(ours, TextTokenizer)
    return load_tokenizer(source), ours


def test_encode_and_decode_match_transformers(pair: tuple[Any, TextTokenizer]) -> None:
    hf, ours = pair
    for text in TEXTS:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, text
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_vocabulary_and_special_tokens_match_transformers(pair: tuple[Any, TextTokenizer]) -> None:
    hf, ours = pair
    assert len(ours) == len(hf)
    assert ours.get_vocab() == hf.get_vocab()
    assert set(ours.added_tokens_decoder) == set(hf.added_tokens_decoder)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (hf.eos_token_id, hf.bos_token_id,
                                                                             hf.all_special_ids)
    assert all(ours.convert_ids_to_tokens(i) == hf.convert_ids_to_tokens(i) for i in range(len(hf)))


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c "}],
    [{"role": "user", "content": "q", "name": None}, {"role": "assistant", "content": "partial answer"}],
]


@pytest.mark.parametrize("options", [{"add_generation_prompt": True}, {"add_generation_prompt": False},
                                     {"continue_final_message": True}])
def test_model_chat_template_renders_as_transformers_does(pair: tuple[Any, TextTokenizer],
                                                          options: dict[str, bool]) -> None:
    hf, ours = pair
    for chat in CHATS:
        if options.get("continue_final_message") and chat[-1]["role"] != "assistant":
            continue
        assert ours.apply_chat_template(chat, **options) == hf.apply_chat_template(chat, tokenize=False, **options)
        assert ours.apply_chat_template(chat, tokenize=True, **options) == list(
            hf.apply_chat_template(chat, tokenize=True, return_dict=False, **options))


# Templates using what transformers' environment adds: namespace, tojson, raise_exception, loop controls,
# {% generation %} blocks, tools, trimming of blocks and the special tokens as variables.
TEMPLATES = [
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ bos_token }}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}{{ ns.n }}"
    "{% if add_generation_prompt %}assistant:{% endif %}",
    "{% if tools %}{{ tools | tojson(indent=2) }}\n{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] | tojson }}{% endif %}\n{% endfor %}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\n  {{ m.content }}\n{% endfor %}",
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ m.reasoning_content or '' }}|{{ m.content }}{% endfor %}",
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <b>now</b>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("template", TEMPLATES)
def test_transformers_template_features_render_the_same(pair: tuple[Any, TextTokenizer], template: str) -> None:
    hf, ours = pair
    chats = [*CHATS, [{"role": "system", "content": "s"}, {"role": "user", "content": "ü"}],
             [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning": "because"}]]
    for chat in chats:
        for tools in (None, TOOLS):
            try:
                expected: Any = hf.apply_chat_template(chat, chat_template=template, tools=tools, tokenize=False,
                                                       add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - then ours must refuse too
                expected = type(exc).__name__
            try:
                got: Any = render_chat(template, chat, tools=tools, add_generation_prompt=True,
                                       variables=dict(hf.special_tokens_map))
            except Exception as exc:  # noqa: BLE001
                got = type(exc).__name__
            assert got == expected, (template, chat, tools)


def test_continue_final_message_needs_the_content_in_the_template() -> None:
    with pytest.raises(TemplateRejected):
        render_chat("{% for m in messages %}{{ m.role }}{% endfor %}", [{"role": "assistant", "content": "x"}],
                    continue_final_message=True)


def test_the_actors_load_it_without_torch_or_transformers(pair: tuple[Any, TextTokenizer]) -> None:
    code = ("import sys; from ringserve.actors.common.model_source import resolve_model; "
            "from ringserve.actors.common.text_tokenizer import load_text_model; "
            f"m = load_text_model(resolve_model({DEFAULT_MODEL!r})); "
            "print(type(m.tokenizer).__name__, m.tokenizer.encode('Hello world'), "
            "[n for n in ('torch', 'transformers') if n in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TextTokenizer", "[19556,", "905]", "[]"]


def test_a_tokenizer_it_cannot_reproduce_is_served_by_transformers(tmp_path: Path, caplog: Any) -> None:
    load_tokenizer(resolve_model(DEFAULT_MODEL)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 49152,
                                                      "max_position_embeddings": 512, "eos_token_id": 2}))
    with caplog.at_level("INFO", logger="text_tokenizer"):
        model = load_text_model(ModelSource(str(tmp_path), None, "split"))
    assert not isinstance(model.tokenizer, TextTokenizer)
    assert model.tokenizer.encode("<|im_start|>", add_special_tokens=False) != [1]  # split, as configured
    assert (model.context_length, model.vocab_size, model.eos_token_ids) == (512, 49152, [2])
    assert "splits special tokens" in caplog.text


def test_the_processes_around_the_scheduler_import_no_torch() -> None:
    modules = ["ringserve.actors.launcher.cli", "ringserve.actors.launcher.ring", "ringserve.actors.entry.app", "ringserve.actors.tokenizer.actor",
               "ringserve.actors.detokenizer.actor"]
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
            "sys.modules['ringserve.actors.launcher.cli'].build_parser().parse_args(['serve']); "  # every flag declared
            "print([n for n in ('torch', 'transformers', 'xgrammar') if n in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_xgrammar_gets_transformers_tokenizer_the_export_came_from(pair: tuple[Any, TextTokenizer]) -> None:
    hf, ours = pair
    loaded = transformers_tokenizer(ours)
    assert not isinstance(loaded, TextTokenizer) and loaded.get_vocab() == hf.get_vocab()
    assert transformers_tokenizer(ours) is loaded and transformers_tokenizer(hf) is hf
