"""Keeps torch at one thread in actors that only import it indirectly (through transformers).

On a small machine two processes running torch's thread pools thrash; only the scheduler computes with torch.
"""

from __future__ import annotations

import os


def limit_torch_threads() -> None:
    """Cap the OpenMP/MKL/BLAS pools; call before anything imports torch (the pools read these at import)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
