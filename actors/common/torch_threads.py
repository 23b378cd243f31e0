"""Keeps torch at one thread in actors that only import it indirectly (through transformers).

On a small machine two processes running torch's thread pools thrash; only the scheduler computes with torch.
"""

from __future__ import annotations

import os
import sys


def limit_torch_threads() -> None:
    """Cap OpenMP/MKL pools before torch can be imported, then torch's own pools if it is already loaded."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
