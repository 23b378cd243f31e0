"""One import name: ours load as `ringserve.*`, Hugging Face's `kernels` keeps its own top-level name beside
them, and no file imports a top-level `actors`, `bus`, `kernels` or `observability` (docs/development.md)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("actors", "bus", "kernels", "observability")
OLD_IMPORT = re.compile(r"^\s*(?:from|import)\s+(?:" + "|".join(OURS) + r")(?:[.\s]|$)", re.M)
OLD_MODULE_STRING = re.compile(r"""["'](?:-m\s+)?(?:""" + "|".join(OURS) + r""")\.[a-z_]+\.""")
# inside code strings run with `python -c`: an old name after `import torch, ` or after `from ` in a string
OLD_IN_CODE = re.compile(r"(?:\bimport\s+(?:[\w.]+\s*,\s*)*|\bfrom\s+)(?<![\w.])(?:" + "|".join(OURS) + r")\.[a-z_]")


def _python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split()]


def test_no_file_imports_our_packages_by_a_top_level_name() -> None:
    old = []
    for path in _python_files():
        text = path.read_text(encoding="utf-8")
        old += [f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
                for pattern in (OLD_IMPORT, OLD_MODULE_STRING, OLD_IN_CODE) for match in pattern.finditer(text)]
    assert not old, "import these as ringserve.<package>:\n  " + "\n  ".join(old)


def test_the_top_level_folders_are_no_packages_of_their_own() -> None:
    assert [top for top in OURS if (ROOT / top / "__init__.py").exists()] == []


def test_hugging_face_kernels_and_ours_load_side_by_side_from_the_checkout() -> None:
    """Run from the checkout's root (on sys.path, as pytest and `python -m` put it): `kernels` is theirs."""
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("Hugging Face's `kernels` is not installed: transformers >= 5.25 requires it, and this test is "
                    "what shows the two names cannot meet (scripts/setup.sh installs the newest transformers)")
    code = ("import kernels, transformers, ringserve.kernels.cpu as ours, ringserve.actors.engine.models.llama; "
            "print(kernels.__file__); print(ours.__file__); print(transformers.__version__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs, ours, version = done.stdout.split()
    assert "site-packages" in theirs and not theirs.startswith(str(ROOT / "kernels")), theirs
    assert Path(ours) == ROOT / "kernels" / "cpu" / "__init__.py"
    assert tuple(int(part) for part in version.split(".")[:2]) >= (5, 25), version
