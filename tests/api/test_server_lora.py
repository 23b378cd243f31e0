"""LoRA adapters through the ring: one tiny-model server started with an adapter (`--lora-modules`) and
`--lora-dir`; the official `openai` client picks adapters with `model` ("name" or "<served>:name") and gets
transformers + PEFT's greedy tokens; /v1/models lists them with their parent; an adapter loaded at run time is
used, unloaded (then a 404 in OpenAI's shape), and reloaded; a path outside --lora-dir and a malformed adapter
are 400s and the server serves on. Chat, Anthropic Messages, Responses and embeddings take the adapter by `model`
too; /metrics counts an adapter's requests and tokens under its name; the request's trace names the adapter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import numpy as np
import openai
import pytest

from tests.engine_helpers import hf_greedy
from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import ServerHandle, start_server
from tests.models.test_lora import make_adapter

PROMPT = [1, 504, 2031, 77, 9001, 311, 42]
N = 6


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerHandle, dict[str, Any]]]:
    """The server and, per adapter name, (directory, PEFT model); adapter "b" is not loaded at start."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    root = tmp_path_factory.mktemp("lora-dir")
    adapters = {name: (str(root / name), make_adapter(hf, root / name, seed, r=r))
                for seed, (name, r) in enumerate([("a", 8), ("b", 16)], start=1)}
    adapters["base"] = ("", hf)
    receiver = OtlpReceiver().__enter__()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        server = start_server(str(tiny_model_dir), extra=["--lora-modules", json.dumps({"name": "a", "path": str(adapters['a'][0])}),
                                                           "--lora-dir", str(root), "--otlp-endpoint", receiver.url])
    adapters["spans"] = receiver
    try:
        yield server, adapters
    finally:
        assert server.stop() == 0
        receiver.__exit__(None, None, None)


def complete(server: ServerHandle, model: str) -> list[int]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert reply.model == model
    return reply.choices[0].token_ids  # type: ignore[attr-defined]


def served(server: ServerHandle) -> str:
    return httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]


def control(server: ServerHandle, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, timeout=60)


def test_the_model_field_picks_an_adapter(setup: Any) -> None:
    server, adapters = setup
    expected = hf_greedy(adapters["a"][1], PROMPT, N, None)
    assert expected != hf_greedy(adapters["base"][1], PROMPT, N, None)
    assert complete(server, "a") == expected
    assert complete(server, f"{served(server)}:a") == expected
    assert complete(server, served(server)) == hf_greedy(adapters["base"][1], PROMPT, N, None)
    native = httpx.post(server.base_url + "/generate", timeout=60, json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": N, "temperature": 0, "ignore_eos": True, "lora_name": "a"}})
    assert native.json()["output_ids"] == expected, native.text
    unknown = httpx.post(server.base_url + "/generate", timeout=60, json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": N, "lora_name": "zz"}})
    assert unknown.status_code == 404 and "'zz'" in unknown.json()["error"]["message"], unknown.text
    cards = httpx.get(server.base_url + "/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [(served(server), None), ("a", served(server))]
    assert httpx.get(server.base_url + "/v1/models/a").json()["parent"] == served(server)
    assert httpx.get(server.base_url + "/v1/models/zz").status_code == 404


def test_load_use_unload_reload(setup: Any) -> None:
    server, adapters = setup
    path = adapters["b"][0]
    reply = control(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": path})
    assert reply.status_code == 200, reply.text
    expected = hf_greedy(adapters["b"][1], PROMPT, N, None)
    assert complete(server, "b") == expected
    assert control(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as info:
        complete(server, "b")
    assert info.value.body["type"] == "model_not_found" and "'b'" in info.value.body["message"]
    reply = control(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert reply.status_code == 404, reply.text
    assert control(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": path}).status_code == 200
    assert complete(server, "b") == expected


def test_bad_adapters_are_400s_and_the_server_serves_on(setup: Any, tmp_path: Path) -> None:
    server, adapters = setup
    reply = control(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert reply.status_code == 400 and "outside --lora-dir" in reply.json()["error"]["message"], reply.text
    broken = Path(adapters["a"][0]).parent / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    reply = control(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(broken)})
    assert reply.status_code == 400 and "does not exist" in reply.json()["error"]["message"], reply.text
    reply = control(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path"
    assert complete(server, "a") == hf_greedy(adapters["a"][1], PROMPT, N, None)


def test_every_route_takes_the_adapter_by_model(setup: Any) -> None:
    server, _ = setup
    question = [{"role": "user", "content": "Name a colour."}]
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")

    def chat_text(model: str) -> str:
        reply = chat.chat.completions.create(model=model, messages=question, max_tokens=N, temperature=0)  # type: ignore[arg-type]
        assert reply.model == model
        return reply.choices[0].message.content or ""

    adapted, base = chat_text("a"), chat_text(served(server))
    assert adapted != base
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
    reply = messages.messages.create(model="a", max_tokens=N, messages=question,  # type: ignore[arg-type]
                                     extra_body={"temperature": 0})
    assert reply.model == "a" and reply.content[0].text == adapted  # type: ignore[union-attr]
    counted = messages.messages.count_tokens(model="a", messages=question)  # type: ignore[arg-type]
    assert counted.input_tokens == messages.messages.count_tokens(model=served(server), messages=question).input_tokens  # type: ignore[arg-type]
    with pytest.raises(anthropic.NotFoundError):
        messages.messages.create(model="zz", max_tokens=N, messages=question)  # type: ignore[arg-type]
    response = chat.responses.create(model="a", input=question, max_output_tokens=N, temperature=0)  # type: ignore[arg-type]
    assert response.model == "a" and response.output_text == adapted
    with pytest.raises(openai.NotFoundError):
        chat.responses.create(model="zz", input="hi", max_output_tokens=N)
    vectors = {model: np.array(chat.embeddings.create(model=model, input="a colour").data[0].embedding)
               for model in ("a", served(server))}
    assert not np.allclose(vectors["a"], vectors[served(server)])  # the adapter's hidden states, not the base's
    with pytest.raises(openai.NotFoundError):
        chat.embeddings.create(model="zz", input="a colour")


def test_metrics_and_traces_name_the_adapter(setup: Any) -> None:
    server, adapters = setup
    receiver: OtlpReceiver = adapters["spans"]
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4736"
    reply = httpx.post(server.base_url + "/v1/completions", timeout=60, headers={
        "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}, json={"model": "a", "prompt": PROMPT, "max_tokens": N,
                                                                  "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    spans = receiver.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == "POST /v1/completions"
                                                for s in spans))
    [root] = [s for s in spans if s.trace_id == trace_id and s.name == "POST /v1/completions"]
    assert root.attributes["ringserve.lora_name"] == "a"
    scrape = httpx.get(server.base_url + "/metrics").text

    def value(series: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines() if line.startswith(series))

    assert value('ringserve:generation_tokens_total{model_name="a"}') >= N
    assert value('ringserve:num_requests_total{finish_reason="length",model_name="a"}') >= 1
    assert value(f'ringserve:generation_tokens_total{{model_name="{served(server)}"}}') >= 0
    assert 'model_name="zz"' not in scrape  # a name no adapter has labels no series
