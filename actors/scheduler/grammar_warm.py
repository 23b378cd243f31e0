"""The scheduler's grammar warm-up, started before its weights load (`--grammar-warm-up`, on by default).

The compile worker process (compile_pool's `prestart`: importing torch and xgrammar, about 4 s of CPU) starts
first, then the model's tokenizer is loaded (under a second) and a `GrammarManager` for it starts making the
compiler (xgrammar, transformers' tokenizer, the tokenizer info: about 10 s of CPU on a loaded 2-core host, or,
from the second start on, the tokenizer info read from the cache: actors/common/grammar_vocab.py) and
compiling a tiny grammar on a thread of its own. All of it overlaps the weights' load and the engine's build
instead of following them; the engine's own manager then takes the warm compiler over (`hand_to`), and the
scheduler's ready waits for what is left of the warm-up as before (actors/engine/scheduling/grammar.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ringserve.actors.common.text_tokenizer import load_text_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.scheduling.grammar import GrammarManager
from ringserve.kernels.grammar.compile_pool import prestart
from ringserve.observability.logging import log_event

log = logging.getLogger("scheduler")


@dataclass
class EarlyGrammars:
    """The tokenizer the engine is to be built with, and the manager warming a compiler for it."""

    tokenizer: Any
    manager: GrammarManager

    def hand_to(self, grammars: GrammarManager | None) -> None:
        """Give the warm-up to the engine's manager `grammars`; where it cannot take it (no manager, another
        vocabulary width), close it, so its worker holds no memory, and the engine's manager warms its own."""
        if grammars is not None and grammars.adopt(self.manager):
            return
        log_event(log, logging.INFO, "the early grammar warm-up was not used: the engine's compiler warms anew")
        self.manager.close()


def early_grammars(source: Any, config: EngineConfig) -> EarlyGrammars:
    """Start the compile worker and the compiler's warm-up for `source`'s tokenizer now (before the weights)."""
    prestart()
    _import_first()
    text_model = load_text_model(source)
    manager = GrammarManager(text_model.tokenizer, text_model.vocab_size, config.grammar_compile_timeout)
    manager.warm_up()
    return EarlyGrammars(text_model.tokenizer, manager)


def _import_first() -> None:
    """Import here, before the warm-up's thread starts, what it and the weights' load both import: two threads
    importing transformers at once can find it half made ("cannot import name 'AutoConfig'")."""
    import transformers
    import xgrammar  # noqa: F401  # imports transformers' tokenizer classes too

    transformers.AutoConfig, transformers.AutoTokenizer  # noqa: B018  # its lazy submodules, imported on access
