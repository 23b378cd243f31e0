"""LoRA adapters in the engine: PEFT's own random adapters on tiny models give PEFT's greedy tokens, alone and
batched with other adapters and the base model; the prefix cache keeps adapters apart; the host LRU evicts and
reloads; malformed adapters are clear errors while the engine serves on; int8 base weights take adapters."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.actors.engine.quantization.quantize import apply_quantization
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.kv_blocks import BLOCK, block_hashes, cache_namespace, salt_seed
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import (assert_greedy_matches, engine_for, greedy, hf_greedy, run_to_completion,
                                  tiny_hf_llama, tokens_of)
from tests.model_families import tiny_hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], [9, 8, 7, 6, 5, 4, 3, 2, 100]]
N = 8


def make_adapter(hf_model: Any, path: Path, seed: int, r: int = 8, targets: list[str] = ALL,
                 rslora: bool = False) -> Any:
    """A PEFT LoRA adapter with random non-zero A and B on a copy of `hf_model`, saved to `path`; the PEFT model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=2 * r if not rslora else 4, target_modules=targets, lora_dropout=0.0,
                        use_rslora=rslora)
    model = get_peft_model(copy.deepcopy(hf_model), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(str(path))
    return model.eval()


def request(rid: str, ids: list[int], lora: str | None = None) -> TokenizedRequest:
    return TokenizedRequest(rid, list(ids), greedy(N, ignore_eos=True, lora_name=lora))


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, tuple[str, Any]]]:
    """The tiny Llama and four adapters on it: name -> (directory, PEFT model)."""
    hf = tiny_hf_llama()
    root = tmp_path_factory.mktemp("loras")
    specs = {"a8": dict(r=8), "b16": dict(r=16), "rs": dict(r=8, rslora=True), "qonly": dict(r=4, targets=["q_proj"])}
    return hf, {name: (str(root / name), make_adapter(hf, root / name, seed, **kw))
                for seed, (name, kw) in enumerate(specs.items(), start=1)}


@pytest.fixture(scope="module")
def engine(llama_adapters: Any) -> EngineCore:
    hf, adapters = llama_adapters
    modules = ",".join(f"{n}={path}" for n, (path, _) in adapters.items())
    return engine_for(hf, lora_modules=modules, max_loras_per_batch=2)


def peft_tokens(peft_model: Any, ids: list[int]) -> list[int]:
    return hf_greedy(peft_model, ids, N, None)


def test_each_adapter_gives_pefts_tokens(engine: EngineCore, llama_adapters: Any) -> None:
    hf, adapters = llama_adapters
    base = hf_greedy(hf, PROMPTS[0], N, None)
    for name, (_, peft_model) in adapters.items():
        rows = run_to_completion(engine, [request(f"solo-{name}", PROMPTS[0], name)])
        expected = peft_tokens(peft_model, PROMPTS[0])
        assert expected != base, f"adapter {name} must change the output for the test to mean anything"
        assert tokens_of(rows[f"solo-{name}"]) == expected, name


def test_a_batch_mixing_adapters_and_the_base_gives_each_row_its_own(engine: EngineCore, llama_adapters: Any) -> None:
    hf, adapters = llama_adapters
    names = [None, "a8", "b16", "rs", "qonly"]  # 4 adapters, 2 per step: the others wait
    reqs = [request(f"mix-{i}", PROMPTS[1], n) for i, n in enumerate(names)]
    rows = run_to_completion(engine, reqs)
    for i, name in enumerate(names):
        expected = hf_greedy(hf, PROMPTS[1], N, None) if name is None else peft_tokens(adapters[name][1], PROMPTS[1])
        assert tokens_of(rows[f"mix-{i}"]) == expected, name
    assert engine.lora is not None and len(set(engine.lora.slot_names)) <= 2


def test_eager_steps_compute_only_the_slots_in_use(llama_adapters: Any) -> None:
    """Without decode graphs a step computes slots up to the highest one it uses: the same tokens."""
    hf, adapters = llama_adapters
    modules = ",".join(f"{n}={path}" for n, (path, _) in adapters.items())
    eager = engine_for(hf, lora_modules=modules, max_loras_per_batch=4, disable_cuda_graph=True)
    assert eager.lora is not None and not eager.lora.state.fixed
    names = [None, "qonly", "a8", None, "rs"]
    rows = run_to_completion(eager, [request(f"eager-{i}", PROMPTS[1], n) for i, n in enumerate(names)])
    for i, name in enumerate(names):
        expected = hf_greedy(hf, PROMPTS[1], N, None) if name is None else peft_tokens(adapters[name][1], PROMPTS[1])
        assert tokens_of(rows[f"eager-{i}"]) == expected, name
    rows = run_to_completion(eager, [request("eager-base", PROMPTS[0])])
    assert eager.lora.state.active == 0 and tokens_of(rows["eager-base"]) == hf_greedy(hf, PROMPTS[0], N, None)


def test_the_prefix_cache_never_crosses_adapters(engine: EngineCore) -> None:
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    first = run_to_completion(engine, [request("pc-a", ids, "a8")])["pc-a"]
    other = run_to_completion(engine, [request("pc-b", ids, "b16")])["pc-b"]
    again = run_to_completion(engine, [request("pc-a2", ids, "a8")])["pc-a2"]
    base = run_to_completion(engine, [request("pc-base", ids)])["pc-base"]
    assert first[0].cached_tokens == 0 and other[0].cached_tokens == 0 and base[0].cached_tokens == 0
    assert again[0].cached_tokens > 0
    assert tokens_of(again) == tokens_of(first)


def test_an_adapter_replaced_under_its_name_never_reuses_the_old_ones_kv(llama_adapters: Any) -> None:
    """Loading another adapter under a name keys its KV apart (`LoraPool.cache_name`): its answer is the new
    adapter's, not one continued from the old adapter's cached prompt."""
    hf, adapters = llama_adapters
    fresh = engine_for(hf, lora_modules=f"x={adapters['a8'][0]}", max_loras_per_batch=2, disable_cuda_graph=True)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    run_to_completion(fresh, [request("old", ids, "x")])
    assert fresh.load_lora("x", adapters["b16"][0]) is None
    rows = run_to_completion(fresh, [request("new", ids, "x")])["new"]
    assert rows[0].cached_tokens == 0 and tokens_of(rows) == peft_tokens(adapters["b16"][1], ids)
    again = run_to_completion(fresh, [request("new-again", ids, "x")])["new-again"]
    assert again[0].cached_tokens > 0 and tokens_of(again) == tokens_of(rows)


def test_the_router_hashes_an_adapters_blocks_as_the_engine_stores_them(engine: EngineCore) -> None:
    """Cache-aware routing over --dp replicas keys by adapter: the tokenizers' router seeds a prompt's block
    hashes with `cache_namespace`, as the engine's prefix cache reports the blocks it stores."""
    ids = [(7 * i) % 500 + 3 for i in range(2 * BLOCK + 5)]
    engine.kv_events()
    run_to_completion(engine, [request("route", ids, "b16")])
    stored, _ = engine.kv_events()
    ours = block_hashes(ids, BLOCK, salt_seed(cache_namespace(None, "b16")))
    assert ours[0] in stored and ours[1] in stored
    assert block_hashes(ids, BLOCK)[0] not in stored


def test_unknown_and_malformed_adapters_are_clear_errors(engine: EngineCore, llama_adapters: Any,
                                                         tmp_path: Path) -> None:
    error = engine.add_request(request("nope", PROMPTS[0], "nope"))
    assert error is not None and error.code == 404 and error.type == "model_not_found" and "nope" in error.message
    other = tiny_hf_llama(hidden_size=32, intermediate_size=64)
    make_adapter(other, tmp_path / "wrong", seed=9)
    error = engine.load_lora("wrong", str(tmp_path / "wrong"))
    assert error is not None and error.code == 400 and "lora_A" in error.message, error
    error = engine.load_lora("missing", str(tmp_path / "absent"))
    assert error is not None and error.code == 400 and "does not exist" in error.message
    dora = tmp_path / "dora"
    make_adapter(llama_adapters[0], dora, seed=3)
    cfg = (dora / "adapter_config.json").read_text().replace('"use_dora": false', '"use_dora": true')
    (dora / "adapter_config.json").write_text(cfg)
    error = engine.load_lora("dora", str(dora))
    assert error is not None and "DoRA" in error.message
    assert engine.adapters.names() == ["a8", "b16", "qonly", "rs"]
    assert engine.add_request(request("busy", PROMPTS[0], "a8")) is None
    for error in (engine.unload_lora("a8"), engine.load_lora("a8", llama_adapters[1]["b16"][0])):
        assert error is not None and error.code == 409 and "in use" in error.message
    run_to_completion(engine, [])
    _, peft_model = llama_adapters[1]["a8"]
    rows = run_to_completion(engine, [request("after", PROMPTS[0], "a8")])
    assert tokens_of(rows["after"]) == peft_tokens(peft_model, PROMPTS[0])


def test_a_weight_swap_with_adapters_is_refused_clearly(engine: EngineCore) -> None:
    with pytest.raises(ValueError, match="LoRA adapters are served"):
        engine.update_weights(object(), "other")


def test_lru_keeps_one_adapter_loaded_and_reloads(llama_adapters: Any) -> None:
    hf, adapters = llama_adapters
    modules = ",".join(f"{n}={adapters[n][0]}" for n in ("a8", "b16"))
    lru = engine_for(hf, lora_modules=modules, max_loaded_loras=1, max_loras_per_batch=1)
    assert lru.lora is not None
    for i, name in enumerate(["a8", "b16", "a8"]):
        rows = run_to_completion(lru, [request(f"lru-{i}", PROMPTS[0], name)])
        assert tokens_of(rows[f"lru-{i}"]) == peft_tokens(adapters[name][1], PROMPTS[0]), name
        assert list(lru.lora.loaded) == [name]


def test_another_family_qwen3(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen3")
    peft_model = make_adapter(hf, tmp_path / "q3", seed=5)
    qwen = engine_for(hf, lora_modules=f"q3={tmp_path / 'q3'}")
    ids = [1, 2, 3, 4, 5, 6]
    rows = run_to_completion(qwen, [request("q3", ids, "q3"), request("q3-base", ids)])
    assert_greedy_matches(peft_model, ids, peft_tokens(peft_model, ids), tokens_of(rows["q3"]))
    assert_greedy_matches(hf, ids, hf_greedy(hf, ids, N, None), tokens_of(rows["q3-base"]))


def test_int8_base_weights_with_an_adapter_on_top(llama_adapters: Any) -> None:
    hf, adapters = llama_adapters
    path, peft_model = adapters["a8"]
    config = EngineConfig(device="cpu", torch_threads=1, max_total_tokens=4096, quantization="int8",
                          lora_modules=f"a8={path}")
    model = model_from_hf(hf.config, {k: v.clone() for k, v in hf.state_dict().items()}, "cpu")
    assert apply_quantization(model, config)[0] == "int8"
    quantized = EngineCore(model, config)
    rows = run_to_completion(quantized, [request("int8", PROMPTS[0], "a8")])
    assert_greedy_matches(peft_model, PROMPTS[0], peft_tokens(peft_model, PROMPTS[0]), tokens_of(rows["int8"]),
                          tol=0.5)


def test_a_compiled_decode_graph_sees_each_steps_adapters(llama_adapters: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot mask is filled in place, so the compiled batch-size-1 graph runs every adapter and the base."""
    monkeypatch.setenv("RINGSERVE_CPU_GRAPHS", "1")
    monkeypatch.setenv("RINGSERVE_GRAPH_STORE", "0")
    hf, adapters = llama_adapters
    modules = ",".join(f"{n}={adapters[n][0]}" for n in ("a8", "b16"))
    compiled = engine_for(hf, max_total_tokens=1024, cuda_graph_max_bs=1, lora_modules=modules)
    graphs = compiled.runner.graphs
    assert graphs is not None and graphs.compiler is not None
    graphs.compiler.choose = False  # kept however it measures on a busy host
    compiled.start_decode_graphs()
    assert graphs.compiler.wait((1, 1), 900)
    assert compiled.stats().decode_graphs["bs 1, 1 thread"].startswith("compiled")
    for name in ("a8", "b16", None):
        rows = run_to_completion(compiled, [request(f"graph-{name}", PROMPTS[0], name)])
        expected = hf_greedy(hf, PROMPTS[0], N, None) if name is None else peft_tokens(adapters[name][1], PROMPTS[0])
        assert tokens_of(rows[f"graph-{name}"]) == expected, name
