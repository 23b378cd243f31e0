"""`--context-length` (vLLM's `--max-model-len`): the longest sequence served, at most the model's own. A ring on
the tiny 4096-token model capped at 64 tokens reports 64, refuses a longer prompt and a request whose output
would pass the cap, and serves one that reaches it exactly; a cap longer than the model's is refused in one line before any actor starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import start_server

REPO = Path(__file__).resolve().parents[2]
CAP = 64


def test_a_cap_longer_than_the_models_context_is_refused_before_any_actor_starts(tiny_model_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", "--model",
                             str(tiny_model_dir), "--port", "1", "--context-length", "5000"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "--context-length 5000 is longer than the model's own context length 4096" in result.stderr
    assert "started" not in result.stdout + result.stderr


def test_a_capped_ring_serves_at_most_the_cap(tiny_model_dir: Path) -> None:
    server = start_server(str(tiny_model_dir), extra=["--max-model-len", str(CAP)])
    try:
        models = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
        assert models[0]["max_model_len"] == CAP
        too_long = httpx.post(server.base_url + "/generate", json={
            "input_ids": list(range(3, 3 + CAP + 6)), "sampling_params": {"max_new_tokens": 1}}, timeout=60)
        assert too_long.status_code == 400 and str(CAP) in too_long.text, too_long.text
        prompt = list(range(3, 3 + CAP - 10))
        past_cap = httpx.post(server.base_url + "/generate", json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 40}}, timeout=60)
        assert past_cap.status_code == 400, past_cap.text
        assert f"maximum context length is {CAP} tokens" in past_cap.json()["error"]["message"]
        reply = httpx.post(server.base_url + "/generate", json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}},
            timeout=120)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["output_ids"]) == 10  # up to the cap exactly
    finally:
        server.stop()
