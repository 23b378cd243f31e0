"""What docs/python.md and the issue say about the shell and Python tools holds (issue 36, "docs as they are").

`ringserve submit`'s examples run as written against a `ringserve serve` (the shared clients ring, whose NATS
has auth), and without credentials it says what to pass; `--stream` ends its line; `Engine(progress=False)`
exists and shows no bar; a `GenerateDelta` has `finish_reason`; `serve --model DIR` refuses a directory it
cannot serve in one line before any actor starts, architecture first; and a tokenizer actor refuses a
directory without tokenizer files instead of reporting ready.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ringserve
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.messages import FinishReason, RequestOutput
from tests.server_helpers import REPO, ServerHandle, wait_for
from tests.shared_rings import logged

PYTHON_DOC = REPO / "docs" / "python.md"


def ringserve_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def documented_submits() -> list[list[str]]:
    """The `ringserve submit` command lines of docs/python.md's shell examples, as argv lists."""
    blocks = re.findall(r"```bash\n(.*?)```", PYTHON_DOC.read_text(), re.S)
    lines = [line.split("  #")[0] for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("ringserve submit")]


@pytest.fixture(scope="module")
def creds(clients_ring: ServerHandle) -> str:
    """Client c's credentials file, as `ringserve serve --nats-client c` logs it."""
    return logged(clients_ring, r"nats client credentials client=c file=(\S+)")


def test_the_documented_submit_examples_run_as_written(creds: str) -> None:
    examples = documented_submits()
    assert len(examples) >= 2 and any("--messages" in argv for argv in examples), examples
    for argv in examples:
        argv = [creds if arg == "/path/to/client-c.json" else arg for arg in argv]
        argv += [] if "--max-new-tokens" in argv else ["--max-new-tokens", "4"]
        done = ringserve_cmd(*argv)
        assert done.returncode == 0, (argv, done.stdout, done.stderr)
        if "--json" in argv:
            assert json.loads(done.stdout.splitlines()[-1])["body"]["finish"] is not None, done.stdout
        else:
            assert done.stdout.endswith("\n") and "[finish: " in done.stderr, (done.stdout, done.stderr)


def test_submit_without_credentials_says_what_to_pass(clients_ring: ServerHandle) -> None:
    url = logged(clients_ring, r"NATS (nats://[\d.:]+)\)")
    done = ringserve_cmd("submit", "--nats-url", url, "--namespace", clients_ring.namespace, "--messages",
                         '[{"role": "user", "content": "Hi"}]', "--json")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "--creds" in done.stderr and "--nats-client" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # one line: no logging noise before it


def test_submit_stream_ends_its_line_even_when_it_times_out(creds: str) -> None:
    done = ringserve_cmd("submit", "--creds", creds, "--text", "Hello", "--max-new-tokens", "3000", "--ignore-eos",
                         "--stream", "--timeout", "3")
    assert done.returncode == 1 and "no answer within 3s" in done.stderr, (done.stdout[-200:], done.stderr)
    assert done.stdout.strip() and done.stdout.endswith("\n"), done.stdout[-200:]


def test_a_generate_delta_has_its_finish_reason() -> None:
    sampling = {"max_new_tokens": 4}
    middle = ringserve.GenerateDelta.from_output("r", RequestOutput(rid="r", text="a", token_ids=[1]), sampling)
    last = ringserve.GenerateDelta.from_output("r", RequestOutput(rid="r", seq=1, text="b", token_ids=[2],
                                                                  finish=FinishReason("length")), sampling)
    assert middle.finish_reason is None and not middle.finished
    assert last.finish_reason == last.meta_info["finish_reason"] and last.finish_reason["type"] == "length"
    assert "delta.finish_reason" in PYTHON_DOC.read_text()


def test_engine_progress_false_shows_no_bar(tiny_model_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`Engine(progress=False)`, as docs/python.md says: no weight-loading bar from the actors, none for a list
    (even with `progress=True` a bar shows for a list)."""
    with ringserve.Engine(model=str(tiny_model_dir), progress=False, grammar_warm_up=False) as engine:
        results = engine.generate(["a", "b"], {"max_new_tokens": 2})
        assert len(results) == 2
        capfd.readouterr()
        engine.generate(["a", "b"], {"max_new_tokens": 2}, progress=True)
        assert "Generating" in capfd.readouterr().err
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Generating" not in err, err[-2000:]


def model_dir(tmp_path: Path, source: Path, files: tuple[str, ...], model_type: str | None = None) -> Path:
    """A copy of some of `source`'s files, its config.json's model_type changed to `model_type` if given."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in files:
        shutil.copy(source / name, directory / name)
    if model_type is not None:
        config = json.loads((source / "config.json").read_text())
        config.update(model_type=model_type, architectures=["GPT2LMHeadModel"])
        (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("files, model_type, says", [
    (("config.json",), "gpt2", "is an unsupported architecture GPT2LMHeadModel; served are: LlamaForCausalLM, "
                              "MistralForCausalLM, Qwen2ForCausalLM"),  # no weights either: architecture first
    (("config.json", "tokenizer.json"), None, "has no .safetensors weights"),
    (("config.json", "model.safetensors"), None, "has no tokenizer"),
], ids=["architecture", "weights", "tokenizer"])
def test_serve_refuses_a_directory_it_cannot_serve_in_one_line(tiny_model_dir: Path, tmp_path: Path,
                                                               files: tuple[str, ...], model_type: str | None,
                                                               says: str) -> None:
    directory = model_dir(tmp_path, tiny_model_dir, files, model_type)
    done = ringserve_cmd("serve", "--model", str(directory), "--port", "1", timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    # the progress line saying the model is being read, then the refusal: one line, and nothing started
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "reading the model" in lines[0], done.stderr
    assert lines[1].startswith(f"ringserve: {directory} ") and says in lines[1], done.stderr
    assert "started" not in done.stderr, done.stderr


def test_the_tokenizer_refuses_a_directory_without_tokenizer_files(tiny_model_dir: Path, tmp_path: Path,
                                                                   nats_server: EmbeddedNatsServer) -> None:
    directory = model_dir(tmp_path, tiny_model_dir, ("config.json", "model.safetensors"))
    log = tmp_path / "tokenizer.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ringserve.actors.tokenizer", "--nats-url", nats_server.url,
                                 "--namespace", "no-tokenizer", "--model", str(directory)], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        proc.kill()
    wait_for(lambda: log.read_text().strip() != "", 5)
    text = log.read_text()
    assert code == 1 and " ready " not in text, text
    assert text.count("\n") == 1 and "ERROR [tokenizer] cannot serve this model" in text, text
    assert "has no tokenizer" in text, text
