"""`ringserve serve` as a whole: a model that cannot be found fails fast with a message; the flag spellings vLLM's
and SGLang's users paste are taken, or refused saying what to pass instead. Serving a safetensors
directory on the embedded NATS, and fail-stop when an actor or that NATS server dies, are tested on real rings
in tests/faults/test_actor_faults.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server_helpers import REPO


def test_bad_model_fails_fast_with_a_message() -> None:
    result = subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", "--model", "/no/such/model"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "/no/such/model" in result.stderr


def _serve(argv: list[str]):
    import argparse

    from ringserve.actors.launcher.serve_flags import add_serve_arguments

    parser = argparse.ArgumentParser(prog="ringserve serve", exit_on_error=False)
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_serve_takes_the_spellings_vllm_and_sglang_users_paste() -> None:
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.entry.settings import parse_origins

    args = _serve(["--model-path", "m", "--served-model-name", "name", "--tensor-parallel-size", "2",
                   "--data-parallel-size", "3", "--lora-modules", "a1=/x", "a2=/y", "--dtype", "half",
                   "--allowed-origins", '["https://a.example", "https://b.example"]', "--port", "9000"])
    assert (args.model, args.served_model_name, args.tp, args.dp, args.port) == ("m", "name", 2, 3, 9000)
    assert EngineConfig.from_args(args).lora_module_map() == {"a1": "/x", "a2": "/y"}
    assert parse_origins(args.cors_allow_origins) == ["https://a.example", "https://b.example"]
    assert _serve(["--tp-size", "4"]).tp == 4
    assert _serve(["--max-model-len", "64"]).context_length == _serve(["--context-length", "64"]).context_length == 64
    assert parse_origins(_serve(["--cors-allow-origins", "https://a,https://b"]).cors_allow_origins) == \
        ["https://a", "https://b"]


@pytest.mark.parametrize("argv, says", [
    (["--served-model-name", "a", "b"], "one model name"),
    (["--served-model-name", "a", "--served-model-name", "b"], "one model name"),
    (["--api-key", "secret"], "RINGSERVE_API_KEY"),
    (["--api-key"], "RINGSERVE_API_KEY"),
    (["--allowed-origins", '["https://a", 1]'], "strings"),
])
def test_serve_refuses_other_servers_forms_saying_what_to_pass(argv: list[str], says: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentError, match=says) as err:
        _serve(argv)
    assert argv[0] in str(err.value)  # the message names the flag


def test_a_refused_flag_fails_at_once_on_the_command_line() -> None:
    """`--api-key` is refused by the parser, before the model is read: exit 2 and one line saying where the key
    goes, the secret never echoed."""
    result = subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", "--api-key", "s3cr3t"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "export RINGSERVE_API_KEY" in result.stderr and "s3cr3t" not in result.stderr


def test_an_adapter_for_another_base_model_is_refused_before_any_actor_starts(tiny_model_dir) -> None:
    """vLLM's `--lora-modules` JSON may name the adapter's `base_model_name`: it must be the model served (its
    served name or --model); another is refused in one line before anything starts."""
    adapter = '{"name": "a1", "path": "/nowhere", "base_model_name": "other-model"}'
    result = subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", "--model",
                             str(tiny_model_dir), "--served-model-name", "tiny", "--port", "1", "--lora-modules",
                             adapter], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "adapter 'a1' is for base model 'other-model', but this server serves 'tiny'" in result.stderr
    assert "started" not in result.stdout + result.stderr
