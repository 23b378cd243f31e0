"""Our own CPU kernels as torch custom ops: weight-only quantized GEMV/GEMM in groups of 32 (`qgemm.cpp`), a
float32 linear for the few rows of a decode step (`f32_gemv.cpp`, chosen per host by kernels/float_linear.py),
paged decode attention over the KV pool in place (`paged_attention.cpp`, its reference in `attention.py`), a
whole decoder layer of a decode step in one op (`decode_layer.cpp`, its reference in `decode_layer.py`), and
the CPU kernel of the KV write `ringserve::store_kv` (`kv_store.cpp`; schema and torch implementation in
kernels/attention/kv_store.py, which runs where the library is not loaded), and the segmented LoRA update
`ringserve::lora_shrink_expand` (`lora_bgmv.cpp`; schema and torch reference in kernels/lora.py).

`torch.ops.ringserve_cpu.group_linear(x, qweight, scales, mins, bias, out_features, bits)` computes
`x @ W^T + bias` for a weight packed by `ringserve.kernels.cpu.packing` (q8_0, q4_0 or q4_1), quantizing the rows of x
to int8 per block of 32 on each call. The ops' schemas and fake (meta) implementations are defined here, so
they trace into a `torch.compile` graph. Their CPU implementation is the C++ library, found in this order:
1. built at `pip install` (setup.py) as `_ringserve_cpu.so` beside this file; it loads only when its record
   (`_ringserve_cpu.json`) names the current sources' hash and torch version, so an edited .cpp never runs
   a stale build;
2. else JIT-built on first use with `torch.utils.cpp_extension.load` (minutes on 2 cores, once per host, sources
   and torch version) into `~/.cache/ringserve/torch_extensions` (or `$RINGSERVE_CACHE/torch_extensions`), one
   directory per torch version and sources' digest;
3. else, when it cannot be built (no compiler, no ninja, a CPU without AVX2), the torch reference of the
   same math (`reference_group_linear`, `reference_paged_decode_attention`, `reference_decode_layer`), which
   is slow.
`compiled()` says whether the C++ library runs, and the kernel plan never picks the fallback.

Environment: `RINGSERVE_CPU_KERNELS=0` skips the library (the fallback runs; at install it skips the build);
`RINGSERVE_CPU_ISA=avx2` forces the AVX2 path on a host that has AVX-512 VNNI (`set_isa` does the same at
run time).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from typing import Any
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ringserve.kernels.cpu.attention import reference_paged_decode_attention
from ringserve.kernels.cpu.build_record import CFLAGS, LDFLAGS, SOURCES, sources_digest
from ringserve.kernels.cpu.decode_layer import reference_decode_layer
from ringserve.kernels.cpu.packing import PackedWeight, pack, reference_group_linear
from ringserve.kernels.cpu.packing_k8 import reference_k8_linear
from ringserve.kernels.cpu.packing_kbits import reference_kbit_linear

__all__ = ["PackedWeight", "pack", "group_linear", "compiled", "isa", "best_isa", "set_isa", "cache_dir", "linear",
           "paged_decode_attention", "f32_linear"]

log = logging.getLogger("ringserve.kernels.cpu")
OP = "ringserve_cpu::group_linear"
_SOURCE = Path(__file__).with_name("qgemm.cpp")  # the linears' kernels (their measured plans hash it)
ATTENTION_OP = "ringserve_cpu::paged_decode_attention"
_PREBUILT = Path(__file__).with_name("_ringserve_cpu.so")  # setup.py builds it at install
_PREBUILT_RECORD = _PREBUILT.with_suffix(".json")  # {"sources": sources_digest(), "torch": version}

_lib = torch.library.Library("ringserve_cpu", "DEF")
_lib.define("group_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int out_features, "
            "int bits) -> Tensor")
_lib.define("paged_decode_attention(Tensor q, Tensor k_layer, Tensor v_layer, Tensor table, Tensor rows, "
            "Tensor kv_lens, float scale, int window=0, float soft_cap=0.0) -> Tensor")
# the four linears in order qkv, o, gate_up, down; writes the rows' K/V into both pools, in place
_lib.define("decode_layer(Tensor x, Tensor cos, Tensor sin, Tensor norm1, Tensor norm2, float eps, Tensor[] qweights, "
            "Tensor[] scales, Tensor?[] mins, Tensor?[] biases, int[] bits, int[] out_features, Tensor(a!) k_pool, "
            "Tensor(b!) v_pool, int layer, Tensor out_slots, Tensor table, Tensor rows, Tensor kv_lens, "
            "int num_heads, float scale, int window=0, float soft_cap=0.0) -> Tensor")
DECODE_LAYER_OP = "ringserve_cpu::decode_layer"
_lib.define("k8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor wsums, Tensor? bias, "
            "int out_features) -> Tensor")  # the q8_k form of GGUF's K-quants (kquant.cpp)
K8_LINEAR_OP = "ringserve_cpu::k8_linear"
_lib.define("kbit_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int out_features, "
            "int bits) -> Tensor")  # the q4_k/q5_k/q6_k forms of GGUF's 4- to 6-bit blocks (kbits.cpp)
KBIT_LINEAR_OP = "ringserve_cpu::kbit_linear"
_lib.define("f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")  # x [M, K] @ weight[N, K]^T + bias
F32_LINEAR_OP = "ringserve_cpu::f32_linear"


@torch.library.register_fake(OP)
def _group_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                       bias: torch.Tensor | None, out_features: int, bits: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake(K8_LINEAR_OP)
def _k8_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    wsums: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake(KBIT_LINEAR_OP)
def _kbit_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      bias: torch.Tensor | None, out_features: int, bits: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake(ATTENTION_OP)
def _paged_decode_attention_fake(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, table: torch.Tensor,
                                 rows: torch.Tensor, kv_lens: torch.Tensor, scale: float, window: int = 0,
                                 soft_cap: float = 0.0) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.register_fake(DECODE_LAYER_OP)
def _decode_layer_fake(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake(F32_LINEAR_OP)
def _f32_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def reference_f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`f32_linear` in torch (its fallback): `F.linear`."""
    return torch.nn.functional.linear(x, weight, bias)


_state: dict[str, object | None] = {}
_lock = threading.Lock()


def cache_dir() -> Path:
    """Where ringserve caches what it builds and measures: `$RINGSERVE_CACHE` or `~/.cache/ringserve`."""
    configured = os.environ.get("RINGSERVE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "ringserve"


def _lacks_avx2() -> bool:
    """True on an x86 CPU without AVX2, FMA or F16C (per /proc/cpuinfo), where the kernels cannot run."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False  # not Linux: let the build decide
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return flags is not None and not {"avx2", "fma", "f16c"} <= set(flags)


def _prebuilt() -> Path | None:
    """The library built at install, when it was built from these sources against this torch; else None."""
    try:
        record = json.loads(_PREBUILT_RECORD.read_text())
    except (OSError, ValueError):
        return None  # not built at install (or an editable checkout never installed)
    if not _PREBUILT.is_file():
        return None
    if record.get("torch") != torch.__version__ or record.get("sources") != sources_digest():
        log.info("CPU kernels built at install are stale (sources or torch changed since); JIT-building them")
        return None
    return _PREBUILT


def _load_prebuilt() -> bool:
    """Load the library built at install when it is current; False when there is none or it does not load."""
    path = _prebuilt()
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))  # its TORCH_LIBRARY blocks register the ops
    except OSError as exc:  # e.g. built against another build of this torch version: JIT-build it instead
        log.warning("CPU kernels built at install do not load (%s); JIT-building them", exc)
        return False
    return True


def jit_build_dir(source_folder: Path) -> Path:
    """Where the sources in `source_folder` are JIT-built. torch's JIT versioning hashes the .cpp files only: the
    digest in the name covers their headers too. Its ninja file names the sources by absolute path, so two
    checkouts sharing one folder rebuilt the library in turn (4 minutes each): each checkout has its own."""
    checkout = hashlib.sha256(str(source_folder.resolve()).encode()).hexdigest()[:8]
    return cache_dir() / "torch_extensions" / f"torch-{torch.__version__}-{sources_digest()[:12]}-{checkout}"


def _jit_build() -> None:
    """JIT-build (or find built in the cache) and load the library; raises when it cannot be built."""
    from torch.utils import cpp_extension

    build_dir = jit_build_dir(SOURCES[0].parent)
    build_dir.mkdir(parents=True, exist_ok=True)
    # the flags (build_record.py) are setup.py's too: one build serves every x86 host
    start = time.perf_counter()
    with _build_lock(build_dir):
        cpp_extension.load(name="ringserve_qgemm", sources=[str(src) for src in SOURCES],
                           build_directory=str(build_dir), extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           is_python_module=False, verbose=False)  # loads it: its TORCH_LIBRARY blocks register the ops
    seconds = time.perf_counter() - start
    if seconds > 2:  # it was compiled now, not found built
        log.info("CPU quantized kernels built in %.0f s into %s", seconds, build_dir)


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold `build_dir`'s build lock, and clear torch's own lock file there. torch's JIT marks a build with a
    `lock` file that only the build itself removes: a scheduler killed mid-build (its compilers end with it,
    actors/scheduler/process_group.py) left it, and every later start waited on it forever. Ours is an flock,
    which the kernel drops with its holder, so a `lock` file found while holding it is a dead build's."""
    with open(build_dir / "ringserve-build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process building this directory: wait for it
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _build() -> object | None:
    """Load the library (built at install, else JIT-built); its helper ops (`torch.ops.ringserve_qgemm`), or
    None when only the fallback can run."""
    if os.environ.get("RINGSERVE_CPU_KERNELS", "1") == "0":
        return None
    if _lacks_avx2():
        log.warning("CPU quantized kernels need AVX2, FMA and F16C; using the torch fallback")
        return None
    try:
        if not _load_prebuilt():
            _jit_build()
        module = torch.ops.ringserve_qgemm
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch fallback runs instead
        log.warning("CPU quantized kernels not built (%s: %s); using the torch fallback", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        return None
    forced = os.environ.get("RINGSERVE_CPU_ISA")
    if forced:
        module.set_isa(forced)
    return module


def _extension() -> object | None:
    """The loaded library's helper ops (building it on first call), or None when only the fallback runs."""
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                module = _build()
                if module is None:
                    _lib.impl("group_linear", reference_group_linear, "CPU")
                    _lib.impl("k8_linear", reference_k8_linear, "CPU")
                    _lib.impl("kbit_linear", reference_kbit_linear, "CPU")
                    _lib.impl("paged_decode_attention", reference_paged_decode_attention, "CPU")
                    _lib.impl("decode_layer", reference_decode_layer, "CPU")
                    _lib.impl("f32_linear", reference_f32_linear, "CPU")
                _state["module"] = module
    return _state["module"]


def compiled() -> bool:
    """Whether the C++ kernels run (built and loaded); False means the slow torch fallback."""
    return _extension() is not None


def isa() -> str:
    """The ISA path the kernels run: "avx512vnni", "avx2", or "torch" (the fallback)."""
    module = _extension()
    return module.isa() if module is not None else "torch"


def best_isa() -> str:
    """The fastest ISA path this CPU supports ("avx512vnni" or "avx2"; "torch" without the build)."""
    module = _extension()
    return module.best_isa() if module is not None else "torch"


def set_isa(name: str) -> None:
    """Run the "avx512vnni" or "avx2" path from now on (one the CPU supports; for tests and benchmarks)."""
    module = _extension()
    if module is None:
        raise RuntimeError("the CPU kernels are not compiled; only the torch fallback runs")
    module.set_isa(name)


def group_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[M, K]` (float32) times the packed weight, plus `bias`: `[M, out_features]` float32."""
    _extension()
    return torch.ops.ringserve_cpu.group_linear(x, packed.qweight, packed.scales, packed.mins, bias,
                                                packed.out_features, packed.bits)


_LINEAR: Any = None  # set by linear(): the overload packed_linear calls eagerly


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`x` `[M, K]` float32 through `packed`'s own kernel (whatever its format), plus `bias`; inside a compiled
    graph too. The one door quantized layers (kernels/quantization.py) use for a packed weight."""
    if _LINEAR is None and not torch.compiler.is_compiling():
        linear()  # loads the library (or registers the fallback) on first eager use
    if packed.wsums is not None:  # q8_k
        return torch.ops.ringserve_cpu.k8_linear(x, packed.qweight, packed.scales, packed.mins, packed.wsums, bias,
                                                 packed.out_features)
    if packed.scales.dtype == torch.float32:  # q4_k, q5_k, q6_k
        return torch.ops.ringserve_cpu.kbit_linear(x, packed.qweight, packed.scales, packed.mins, bias,
                                                   packed.out_features, packed.bits)
    if torch.compiler.is_compiling():  # the custom op (with its fake) traces; the bare overload not
        return torch.ops.ringserve_cpu.group_linear(x, packed.qweight, packed.scales, packed.mins, bias,
                                                    packed.out_features, packed.bits)
    return _LINEAR(x, packed.qweight, packed.scales, packed.mins, bias, packed.out_features, packed.bits)


def linear() -> object:
    """`group_linear`'s op overload itself (`torch.ops.ringserve_cpu.group_linear.default`): called directly
    it skips the overload resolution of `torch.ops...group_linear(...)`, which a batch-1 step of ~120 linears
    notices."""
    global _LINEAR
    _extension()
    _LINEAR = torch.ops.ringserve_cpu.group_linear.default
    return _LINEAR


def f32_linear() -> object:
    """The float32 linear op's overload (`torch.ops.ringserve_cpu.f32_linear.default`, called as `(x, weight,
    bias)` with `x` `[M, K]` and `weight` `[N, K]` contiguous float32), the library loaded first."""
    _extension()
    return torch.ops.ringserve_cpu.f32_linear.default


def paged_decode_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, table: torch.Tensor,
                           rows: torch.Tensor, kv_lens: torch.Tensor, scale: float, window: int = 0,
                           soft_cap: float = 0.0) -> torch.Tensor:
    """Decode attention read in place from one layer of the KV pool (kernels/cpu/attention.py says the math):
    `q` `[B, H, D]` float32, `table` the int64 request-to-token table, `rows`/`kv_lens` `[B]` int64; `window`
    keys per query (0: all), logits capped at `soft_cap` (0: not)."""
    _extension()
    return torch.ops.ringserve_cpu.paged_decode_attention.default(q, k_layer, v_layer, table, rows, kv_lens, scale,
                                                                  window, soft_cap)
