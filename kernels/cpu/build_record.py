"""What identifies a build of the CPU kernels, for setup.py (which writes it) and kernels.cpu (which checks it).

Torch-free and importable by file path, so the install-time build and the runtime loader compute the one same
hash of the same sources.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE_NAMES = ("qgemm.cpp", "f32_gemv.cpp", "paged_attention.cpp", "decode_layer.cpp", "kv_store.cpp",
                "give_way.cpp", "kquant.cpp", "kbits.cpp", "lora_bgmv.cpp")  # build order
SOURCES = tuple(HERE / name for name in SOURCE_NAMES)
HEADER_NAMES = ("qgemm.h", "paged_attention.h", "simd.h")  # included by the sources: part of what a build is
HEADERS = tuple(HERE / name for name in HEADER_NAMES)
# No -march=native: qgemm.cpp picks AVX-512 VNNI or AVX2 per function at run time, so one build serves every x86
# host; -fopenmp lets at::parallel_for use the OpenMP pool torch already loaded.
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def sources_digest() -> str:
    """sha256 over the kernels' .cpp and .h files' bytes, in order."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()
