"""The `--help` layout of ringserve's commands: the groups flags are filed under, in order, and each flag's
default said once.

A flag's group is part of its declaration (actors/common/flag_fields.py: `flag(..., group=TITLE)`);
`GROUP_ORDER` is the order `ringserve serve --help` lists them in.

argparse's ArgumentDefaultsHelpFormatter appends `(default: X)` to every help line, also where the help already
says what the default is ("default: derived from --model") and where there is no value to show (None, an empty
string or list, a switch that is off). `DefaultOnceFormatter` appends it only where the help says nothing of a
default and there is a value to show.
"""

from __future__ import annotations

import argparse
import re

MODEL = "model"
ENGINE = "engine"
SPECULATIVE = "speculative decoding"
LORA = "LoRA"
CHAT = "chat and reasoning"
HTTP = "HTTP"
IMAGES = "images"
ADMISSION = "admission"
SCALE_OUT = "scale-out"
NATS = "NATS"
TRACING = "tracing"  # also written in observability/tracing_config.py, which imports nothing else of ours
PROCESS = "process"
GROUP_ORDER = (MODEL, ENGINE, SPECULATIVE, LORA, CHAT, HTTP, IMAGES, ADMISSION, SCALE_OUT, NATS, TRACING, PROCESS)


SAYS_DEFAULT = re.compile(r"\(default\b|\bdefault:|\bdefaults? to\b", re.IGNORECASE)


def says_default(help_text: str) -> bool:
    """Whether a help text already says what its flag's default is ("(default ...", "default: ...")."""
    return SAYS_DEFAULT.search(help_text) is not None


class DefaultOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """ArgumentDefaultsHelpFormatter without a second default: `(default: X)` only where the help says none
    and X is a value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if says_default(help_text) or not shows_a_value(action.default):
            return help_text
        return super()._get_help_string(action)


def shows_a_value(default: object) -> bool:
    """Whether `(default: X)` would say something: not for None, an empty string or list, or a switch that is
    off (0 is a value: it often means "off" or "automatic" and the help says which)."""
    if default is None or default is argparse.SUPPRESS:
        return False
    return not (isinstance(default, (str, list, tuple, bool)) and not default)
