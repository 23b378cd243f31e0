"""`ringserve serve` as a whole: a model that cannot be found fails fast with a message. Serving a safetensors
directory on the embedded NATS, and fail-stop when an actor or that NATS server dies, are tested on real rings
in tests/faults/test_actor_faults.py."""

from __future__ import annotations

import subprocess
import sys

from tests.server_helpers import REPO


def test_bad_model_fails_fast_with_a_message() -> None:
    result = subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", "--model", "/no/such/model"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "/no/such/model" in result.stderr
