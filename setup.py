"""Builds the CPU kernels at install time; all of the package's metadata but its package list lives in
pyproject.toml (`_packages`: the top-level folders installed as `ringserve.<folder>`).

The `kernels/cpu` sources (build_record.py lists them and their headers) are compiled with `torch.utils.cpp_extension` into
one plain shared library, `kernels/cpu/_ringserve_cpu.so` (not a Python module: `ringserve.kernels.cpu` loads it with
`torch.ops.load_library` and its TORCH_LIBRARY blocks register the ops). Beside it, `_ringserve_cpu.json`
records the sources' hash, the flags and the torch version it was built with, so a checkout whose .cpp files
changed since, or a venv whose torch did, does not load a stale build, and an editable install over a current
build (setup.sh run again) skips the rebuild.

A failed build (no compiler, no torch at build time) warns and installs without the library: `ringserve.kernels.cpu` then
JIT-builds it on first use, or runs its torch fallback. `RINGSERVE_CPU_KERNELS=0` skips the build.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from setuptools import setup

ROOT = Path(__file__).resolve().parent
NAME = "ringserve.kernels.cpu._ringserve_cpu"
LAYOUT = ("actors", "bus", "kernels", "observability")  # the top-level folders, installed as ringserve.<folder>


def _build_record() -> Any:
    """kernels/cpu/build_record.py, loaded by path (importing the package would need it installed)."""
    spec = importlib.util.spec_from_file_location("ringserve_build_record", ROOT / "kernels/cpu/build_record.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


SOURCES = [f"kernels/cpu/{name}" for name in _build_record().SOURCE_NAMES]
HEADERS = [f"kernels/cpu/{name}" for name in _build_record().HEADER_NAMES]
# The flags kernels.cpu JIT-builds with (build_record.py), plus two: setuptools puts Python's own CFLAGS first
# (`-g -fwrapv -O3 -Wall -DNDEBUG` on CPython), and -g0 and -fno-wrapv undo the two that change the code.
CFLAGS = [*_build_record().CFLAGS, "-g0", "-fno-wrapv"]
LDFLAGS = list(_build_record().LDFLAGS)


def _sidecar(library: str) -> str:
    """The build record beside a built library: `_ringserve_cpu.so` -> `_ringserve_cpu.json`."""
    return str(Path(library).with_suffix(".json"))


def _record(torch_version: str) -> dict:
    """What a build is recorded with: kernels.cpu loads it only while `sources` and `torch` still match."""
    return {"sources": _build_record().sources_digest(), "torch": torch_version,
            "flags": CFLAGS + LDFLAGS}


def _is_current(library: str, torch_version: str) -> bool:
    """Whether `library` exists and was built from these sources and flags against this torch."""
    try:
        return os.path.exists(library) and json.loads(Path(_sidecar(library)).read_text()) == _record(torch_version)
    except (OSError, ValueError):
        return False


def _skip(reason: str) -> dict:
    """Warn that the library is not built, and why; no setup() arguments."""
    warnings.warn(f"ringserve: CPU kernels not built at install ({reason}); kernels.cpu will JIT-build them on "
                  "first use or run its torch fallback", stacklevel=2)
    return {}


def _kernels_build() -> dict:
    """setup() arguments that build the library, or none (with a warning) when it cannot be built."""
    if os.environ.get("RINGSERVE_CPU_KERNELS", "1") == "0":
        return _skip("RINGSERVE_CPU_KERNELS=0")
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        return _skip(f"torch is not importable at build time: {exc}")

    class BuildKernels(BuildExtension):
        """BuildExtension that writes the build record and turns any failure into a warning."""

        def run(self) -> None:
            if self.inplace and all(_is_current(self._inplace_file(ext), torch.__version__) for ext in self.extensions):
                return  # an editable install over a current build (setup.sh run again): no rebuild of minutes
            try:
                super().run()
            except Exception as exc:  # no compiler, a failed compile or link: install without the library
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                _skip(f"{type(exc).__name__}: {first_line}")

        def build_extension(self, ext) -> None:
            super().build_extension(ext)
            record = _record(torch.__version__)
            Path(_sidecar(self.get_ext_fullpath(ext.name))).write_text(json.dumps(record) + "\n")

        def copy_extensions_to_source(self) -> None:  # editable installs: the record goes along
            super().copy_extensions_to_source()
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
                if os.path.exists(_sidecar(regular_file)):
                    shutil.copyfile(_sidecar(regular_file), _sidecar(inplace_file))

        def _inplace_file(self, ext) -> str:
            """Where an editable install puts the library: in the source tree."""
            return self._get_inplace_equivalent(self.get_finalized_command("build_py"), ext)[0]

    extension = CppExtension(NAME, list(SOURCES), extra_compile_args={"cxx": CFLAGS}, extra_link_args=LDFLAGS,
                             depends=HEADERS, optional=True)
    return {"ext_modules": [extension],
            "cmdclass": {"build_ext": BuildKernels.with_options(no_python_abi_suffix=True)}}


def _packages() -> dict:
    """setup() arguments that install the top-level folders as `ringserve.<folder>` (docs/development.md,
    "One import name"): every folder below them holding Python files is a package."""
    packages, package_dir = ["ringserve"], {"ringserve": "ringserve"}
    for top in LAYOUT:
        package_dir[f"ringserve.{top}"] = top
        folders = {path.parent.relative_to(ROOT) for path in (ROOT / top).rglob("*.py")} | {Path(top)}
        packages += sorted("ringserve." + ".".join(folder.parts) for folder in folders)
    return {"packages": packages, "package_dir": package_dir}


setup(**_packages(), **_kernels_build())
