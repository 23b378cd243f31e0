"""The model's tokenizer for the tokenizer and detokenizer actors, without transformers or torch.

Importing transformers' tokenizer takes seconds in every process that starts (it imports torch), and the actors
that only encode, decode and render the chat template need none of it. So the first process that needs a
model's tokenizer exports what transformers made of it (its `tokenizers` backend as transformers configured it,
the special tokens, the chat template, and three numbers from the model's config) into a cache, after checking
that the export encodes, decodes and renders as transformers does. Every later start loads the export with the
`tokenizers` library and jinja2 alone (`load_text_model`). A tokenizer the export cannot reproduce is served by
transformers itself, as before; the reason is logged.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringserve.actors.common import startup_cache
from ringserve.actors.common.chat_template import TemplateRejected, render_chat, select_template
from ringserve.actors.common.model_catalog import context_length
from ringserve.actors.common.model_source import (
    ModelSource, cache_root, check_tokenizer_files, converting, gguf_cache_key, publish_directory,
)

log = logging.getLogger("text_tokenizer")
FORMAT = 3  # bump when the export's contents change (2: a family's fallback chat template; 3: dynamic rotary scaling's context)
EXPORT_FILE = "text_model.json"
BACKEND_FILE = "tokenizer.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")
_SAMPLE_TEXTS = ("Hello world", "  two leading spaces, trailing one ", "tabs\tand\nnew lines\n\n",
                 "émoji 🤖, 中文, ünïcödé", "1234567890 + 3.14159 = x", "def f(x):\n    return x**2\n")
_SAMPLE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "2+2?"}]


class TextTokenizer:
    """Encode, decode and the chat template, with the names transformers' tokenizers use for them."""

    def __init__(self, backend: Any, meta: dict[str, Any], source: ModelSource | None = None) -> None:
        """`source`: the model, for `transformers_tokenizer` (None: there is none to load)."""
        self._source = source
        self._transformers: Any = None
        self.backend_tokenizer = backend  # a tokenizers.Tokenizer, configured as transformers configured it
        self.chat_template: str | dict[str, str] | None = meta["chat_template"]
        self.special_tokens_map: dict[str, str] = meta["special_tokens_map"]
        self.eos_token_id: int | None = meta["eos_token_id"]
        self.bos_token_id: int | None = meta["bos_token_id"]
        self.all_special_ids: list[int] = meta["all_special_ids"]
        self._length: int = meta["length"]

    def __len__(self) -> int:
        return self._length

    @property
    def source(self) -> ModelSource | None:
        """The model this tokenizer was exported from (None: not known)."""
        return self._source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the model's BOS/EOS when `add_special_tokens`."""
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """The text of `ids`. No space clean-up: the export refuses tokenizers that would apply it."""
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is not supported by the exported tokenizer")
        return str(self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        """The vocabulary piece of `token_id`."""
        return self.backend_tokenizer.id_to_token(token_id)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of vocabulary piece `token`."""
        return self.backend_tokenizer.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """Every piece and its id, added tokens included."""
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """Added tokens by id (the special ones among them)."""
        return dict(self.backend_tokenizer.get_added_tokens_decoder())

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, tools: list[Any] | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = False, return_dict: bool = False, **variables: Any) -> str | list[int]:
        """The prompt text of `conversation`, or with `tokenize` its ids (no BOS added: the template writes its
        own special tokens). `return_dict` (transformers' encoding object) is not offered."""
        if return_dict:
            raise ValueError("apply_chat_template gives text or ids here, not transformers' encoding dict")
        if continue_final_message and add_generation_prompt:
            raise TemplateRejected("continue_final_message and add_generation_prompt cannot both be set")
        template = select_template(self.chat_template, tools)
        text = render_chat(template, conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           variables={**self.special_tokens_map, **variables})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def transformers_tokenizer(self) -> Any:
        """transformers' own tokenizer of the model, loaded at the first call (xgrammar reads it)."""
        if self._transformers is None:
            if self._source is None:
                raise ValueError("this exported tokenizer has no model source to load transformers' from")
            from ringserve.actors.common.model_source import load_tokenizer

            self._transformers = load_tokenizer(self._source)
        return self._transformers


def transformers_tokenizer(tokenizer: Any) -> Any:
    """transformers' tokenizer for `tokenizer`: itself, or the one a TextTokenizer was exported from."""
    return tokenizer.transformers_tokenizer() if isinstance(tokenizer, TextTokenizer) else tokenizer


@dataclass(frozen=True)
class TextModel:
    """What the text-side actors need of a model: its tokenizer and three numbers from its config."""

    tokenizer: Any  # a TextTokenizer, or transformers' own where the export cannot reproduce it
    context_length: int
    eos_token_ids: list[int]  # every id that ends generation: the config's and the tokenizer's
    vocab_size: int  # the model's logits' width (the tokenizer may count fewer)


def export_key(source: ModelSource) -> str:
    """A key that changes with the model's tokenizer and config files and with the libraries that read them."""
    versions = ":".join(importlib.metadata.version(p) for p in ("transformers", "tokenizers", "jinja2"))
    if source.gguf_file is not None:
        files = gguf_cache_key(source)
    else:
        stats = []
        for path in sorted(Path(source.directory).iterdir()):
            if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
                stat = path.stat()
                stats.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
        files = f"{Path(source.directory).resolve()}|{'|'.join(stats)}"
    return hashlib.sha256(f"{FORMAT}|{versions}|{files}".encode()).hexdigest()[:24]


def load_text_model(source: ModelSource) -> TextModel:
    """The model's tokenizer and limits, from the export in the cache (made first if there is none).

    Raises UnservableModel for a model directory without tokenizer files (transformers would make an empty
    tokenizer of it, which encodes every prompt as no tokens)."""
    check_tokenizer_files(source)
    directory = cache_root() / "text-model" / export_key(source)
    found = (directory / EXPORT_FILE).is_file()
    if not found:
        with converting(directory) as needed:
            found = not needed  # another actor made it meanwhile
            if needed:
                _export(source, directory)
    startup_cache.note("tokenizer export", found)
    meta = json.loads((directory / EXPORT_FILE).read_text())
    if meta["tokenizer"] is not None:
        from tokenizers import Tokenizer

        tokenizer: Any = TextTokenizer(Tokenizer.from_file(str(directory / BACKEND_FILE)), meta["tokenizer"], source)
    else:
        from ringserve.actors.common.model_source import load_tokenizer

        log.info("tokenizer served by transformers: %s", meta["why_transformers"])
        tokenizer = load_tokenizer(source)
    return TextModel(tokenizer, **meta["config"])


def _export(source: ModelSource, directory: Path) -> None:
    from ringserve.actors.common.model_source import load_config, load_tokenizer

    hf, config = load_tokenizer(source), load_config(source)
    config = config.get_text_config()  # a vision-language model's numbers are its text model's
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    limits = {"context_length": context_length(config), "vocab_size": int(config.vocab_size),
              "eos_token_ids": sorted({i for i in [*eos, hf.eos_token_id] if isinstance(i, int)})}
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".staging-"))
    meta: dict[str, Any] = {"format": FORMAT, "config": limits, "tokenizer": None, "why_transformers": None}
    why = _unsupported(hf)
    if why is None:
        backend_json = hf.backend_tokenizer.to_str()
        (staging / BACKEND_FILE).write_text(backend_json)
        from tokenizers import Tokenizer

        tokenizer_meta = {"chat_template": hf.chat_template, "special_tokens_map": dict(hf.special_tokens_map),
                          "eos_token_id": hf.eos_token_id, "bos_token_id": hf.bos_token_id,
                          "all_special_ids": list(hf.all_special_ids), "length": len(hf)}
        why = _mismatch(hf, TextTokenizer(Tokenizer.from_str(backend_json), tokenizer_meta))
        if why is None:
            meta["tokenizer"] = tokenizer_meta
    meta["why_transformers"] = why
    (staging / EXPORT_FILE).write_text(json.dumps(meta))
    publish_directory(staging, directory)


def _unsupported(hf: Any) -> str | None:
    """Why transformers' tokenizer `hf` has no exported form, or None."""
    if getattr(hf, "backend_tokenizer", None) is None:
        return f"{type(hf).__name__} has no tokenizers backend (a slow tokenizer)"
    if getattr(hf, "split_special_tokens", False):
        return "it splits special tokens"
    if hf.clean_up_tokenization_spaces and not (
            type(hf.backend_tokenizer.model).__name__ == "BPE"
            and not getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)):
        return "it cleans up spaces when decoding"
    return None


def _mismatch(hf: Any, ours: TextTokenizer) -> str | None:
    """Where `ours` encodes, decodes or renders differently from transformers' `hf` on sample inputs, or None."""
    specials = "".join(hf.special_tokens_map.values())
    for text in (*_SAMPLE_TEXTS, f"{specials}text between{specials}"):
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            if ours.encode(text, add_special_tokens=add) != ids:
                return f"encoding {text!r} differs"
            for skip in (True, False):
                if ours.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                    return f"decoding {text!r} differs"
    if hf.chat_template is None:
        return None
    for options in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                    {"continue_final_message": True}):
        chat = _SAMPLE_CHAT[:-1] if "continue_final_message" in options else _SAMPLE_CHAT
        try:
            expected = hf.apply_chat_template(chat, tokenize=False, **options)
        except Exception:  # noqa: BLE001 - a template may refuse this conversation; ours must refuse it too
            expected = None
        try:
            got = ours.apply_chat_template(chat, **options)
        except Exception:  # noqa: BLE001
            got = None
        if got != expected:
            return f"the chat template renders differently with {options}"
    return None
