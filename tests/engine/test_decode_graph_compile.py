"""Compiled CPU decode graphs (actors/engine/runner/graphs/decode_graph.py compile mode, graph_compiler.py): sizes compile in
the background while eager steps serve, compiled steps give the eager engine's tokens and KV, the KV write
stays in place inside a compiled graph, and the real SmolLM2 in float32 still equals transformers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ringserve.actors.common.model_source import load_tokenizer, resolve_model
from ringserve.bus.messages import TokenizedRequest
from ringserve.kernels import cpu as cpu_kernels
from ringserve.kernels.attention import kv_store  # noqa: F401  (the op under test)
from tests.engine_helpers import assert_greedy_matches, engine_for, greedy, hf_greedy, run_to_completion, tokens_of
from tests.server_helpers import wait_for

pytestmark = pytest.mark.skipif(not cpu_kernels.compiled(), reason="compiled decode graphs need the CPU kernels")

COMPILE_TIMEOUT = 600.0  # seconds one size may take to compile on a busy 2-core host


@pytest.fixture(autouse=True)
def graphs_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest turns background compiling off for the servers the tests start; these tests compile."""
    monkeypatch.setenv("RINGSERVE_CPU_GRAPHS", "1")


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (4, 9, 6)]


def requests(tag: str, max_new: int = 10) -> list[TokenizedRequest]:
    return [TokenizedRequest(f"{tag}{i}", p, greedy(max_new)) for i, p in enumerate(prompts())]


def test_the_kv_write_op_mutates_the_pool_in_place_inside_a_compiled_graph() -> None:
    pool_k, pool_v = torch.zeros(2, 16, 2, 4), torch.zeros(2, 16, 2, 4)
    k_ptr = pool_k.data_ptr()

    def write(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.ops.ringserve.store_kv(pool_k, pool_v, 1, slots, k, v)
        return pool_k[1, slots].sum()  # read after the write: the graph must keep their order

    compiled = torch.compile(write, fullgraph=True, dynamic=False)
    slots, k, v = torch.tensor([3, 7]), torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    total = compiled(slots, k, v)
    assert pool_k.data_ptr() == k_ptr
    assert torch.equal(pool_k[1, 3], k[0]) and torch.equal(pool_v[1, 7], v[1])
    assert pool_k[0].abs().sum() == 0 and pool_k[1, :3].abs().sum() == 0, "only the two slots were written"
    torch.testing.assert_close(total, k.sum())


def test_sizes_compile_in_the_background_while_eager_steps_serve_the_same_tokens(hf: Any) -> None:
    plain = engine_for(hf, device="cpu", max_total_tokens=512, disable_cuda_graph=True)
    assert plain.runner.graphs is None and plain.stats().decode_graphs == {"mode": "off"}
    engine = engine_for(hf, device="cpu", max_total_tokens=512, cuda_graph_max_bs=4)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.mode == "compile" and graphs.compiler is not None
    graphs.compiler.choose = False  # keep every compiled size, however it measures on this busy host
    assert not graphs.can_run([1]), "nothing is compiled before the server starts compiling"
    assert graphs.report() == {"mode": "compile", "max_bs": "4"}

    engine.start_decode_graphs()  # size 1 at once; size 4 when three requests first decode together
    served = run_to_completion(engine, requests("a"))  # these steps run eagerly while the sizes compile
    expected = {rid: tokens_of(rows) for rid, rows in run_to_completion(plain, requests("a")).items()}
    assert {rid: tokens_of(rows) for rid, rows in served.items()} == expected
    assert graphs.compiler.wait((1, 1), COMPILE_TIMEOUT) and graphs.compiler.wait((4, 1), COMPILE_TIMEOUT)
    report = engine.stats().decode_graphs
    assert report["bs 1, 1 thread"].startswith("compiled") and report["bs 4, 1 thread"].startswith("compiled"), report
    assert not any(key.startswith("bs 2,") for key in report), "a size no batch needed is not compiled"

    replays = 0
    replay = graphs.replay

    def counting(*args: Any) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return replay(*args)

    graphs.replay = counting  # type: ignore[method-assign]
    for engine_ in (plain, engine):
        engine_.flush_cache()
    again = run_to_completion(engine, requests("b"))
    assert replays >= 9, "three requests decode their 9 steps as one padded batch of four, compiled"
    reference = run_to_completion(plain, requests("b"))
    for i, prompt in enumerate(prompts()):
        got = tokens_of(again[f"b{i}"])
        assert got == tokens_of(reference[f"b{i}"])
        assert_greedy_matches(hf, prompt, hf_greedy(hf, prompt, 10, None), got)
    scratch = engine.pool.scratch_slot
    torch.testing.assert_close(engine.pool.k[:, :scratch], plain.pool.k[:, :scratch], atol=1e-5, rtol=1e-5)
    engine.check_integrity()

    # A graph is guarded on the torch thread count it was compiled with: on two threads (the thread tuner's
    # other choice) the same size is another graph, compiled when first needed, never recompiled in the step.
    torch.set_num_threads(2)
    try:
        assert not graphs.can_run([1]), "the one-thread graph does not run on two threads"
        assert graphs.compiler.wait((1, 2), COMPILE_TIMEOUT)
        two = run_to_completion(engine, [TokenizedRequest("t2", prompts()[0], greedy(10))])
    finally:
        torch.set_num_threads(1)
    report = engine.stats().decode_graphs
    assert report["bs 1, 2 threads"].startswith("compiled") and not any("failed" in v for v in report.values())
    assert tokens_of(two["t2"]) == tokens_of(reference["b0"])
    # With nothing queued the compile thread ends (an idle one keeps an OpenMP team that slows every op of the
    # serving thread); the next size asked for starts another.
    assert wait_for(lambda: not compiler_threads()), "the compile thread lives on with nothing to compile"
    graphs.compiler.request((2, 1))
    assert graphs.compiler.wait((2, 1), COMPILE_TIMEOUT) and wait_for(lambda: not compiler_threads())
    graphs.close()


def compiler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "decode-graph-compiler"]


def test_smollm2_float32_compiled_decode_still_equals_transformers(smollm_hf: Any) -> None:
    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))
    # the session's transformers model's own tensors (loading the GGUF a second time would cost ~15 s)
    engine = engine_for(smollm_hf, tokenizer, cuda_graph_max_bs=1, max_total_tokens=4096)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.compiler is not None
    graphs.compiler.choose = False
    engine.start_decode_graphs()
    assert graphs.compiler.wait((1, 1), COMPILE_TIMEOUT), graphs.report()
    eos = tokenizer.eos_token_id
    for i, text in enumerate(["What is the capital of France?", "Write a haiku about the sea.", "用一句话介绍你自己 😀"]):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        rows = run_to_completion(engine, [TokenizedRequest(f"s{i}", prompt, greedy(24, stop_token_ids=[eos]))])
        assert_greedy_matches(smollm_hf, prompt, hf_greedy(smollm_hf, prompt, 24, eos), tokens_of(rows[f"s{i}"]))
    assert engine.stats().decode_graphs["bs 1, 1 thread"].startswith("compiled")
    graphs.close()


def test_swapped_weights_are_compiled_again_and_serve_the_new_weights_tokens() -> None:
    """int8 layers are new modules after a swap: every compiled size is dropped, steps run eagerly until it is
    compiled again over the new layers, and the tokens are those of an engine built on the new weights."""
    from ringserve.actors.engine.models.weights import Checkpoint, model_from_hf
    from ringserve.kernels.quantization import quantize_linears
    from tests.engine_helpers import tiny_hf_llama

    old, new = tiny_hf_llama(seed=0), tiny_hf_llama(seed=1)
    engine = engine_for(old, device="cpu", max_total_tokens=512, cuda_graph_max_bs=1)
    reference = engine_for(new, device="cpu", max_total_tokens=512, disable_cuda_graph=True)
    for e in (engine, reference):
        quantize_linears(e.runner.model, "int8")
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.compiler is not None
    graphs.compiler.choose = False
    engine.start_decode_graphs()
    assert graphs.compiler.wait((1, 1), COMPILE_TIMEOUT)
    old_graph = graphs.compiler.ready((1, 1))
    checkpoint = Checkpoint("v2", new.config, dict(model_from_hf(new.config, new.state_dict()).state_dict()))
    engine.update_weights(checkpoint, "v2")
    assert graphs.compiler.ready((1, 1)) is None and not graphs.can_run([1]), "the old graph is not replayed"
    assert graphs.compiler.wait((1, 1), COMPILE_TIMEOUT)
    assert graphs.compiler.ready((1, 1)) is not old_graph
    assert engine.stats().decode_graphs["bs 1, 1 thread"].startswith("compiled")
    prompt = [1, 5, 9, 14, 22]
    got = run_to_completion(engine, [TokenizedRequest("a", prompt, greedy(12))])
    expected = run_to_completion(reference, [TokenizedRequest("a", prompt, greedy(12))])
    assert tokens_of(got["a"]) == tokens_of(expected["a"])
    graphs.close()


class Tiny(torch.nn.Module):
    """A module shaped like `DecodeStep`: its forward calls a decorated model forward."""

    def __init__(self, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(width, width)

    @torch.no_grad()  # as the real model's forward
    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.proj(x)) * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_graphs_are_stored_per_thread_count_and_a_restart_loads_them_over_its_own_weights(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled graph is written to disk under everything it was compiled from; a new compiler (a restart)
    loads it without tracing and runs its own module's weights through it. A graph holds its thread count in
    its guards: the 2-thread graph is refused on a 1-thread caller."""
    from ringserve.actors.engine.runner.graphs import graph_compiler
    from ringserve.actors.engine.runner.graphs.graph_compiler import BackgroundCompiler
    from ringserve.actors.engine.runner.graphs.graph_store import GraphStore

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    traced: list[int] = []
    real_compile = graph_compiler.compile_graph
    monkeypatch.setattr(graph_compiler, "compile_graph",
                        lambda module, inputs, options=None: traced.append(1) or real_compile(module, inputs, options))
    x = torch.randn(1, 16)
    first = BackgroundCompiler(Tiny(seed=0), lambda bs: (x[:bs].clone(),), progress=False, choose=False)
    for key in ((1, 1), (1, 2)):
        first.request(key)
        assert first.wait(key, COMPILE_TIMEOUT), first.report()
    assert len(traced) == 2 and len(list((tmp_path / "decode_graphs").glob("*.graph"))) == 2
    assert not any("stored" in state for state in first.report().values()), first.report()
    first.close()

    restarted_module = Tiny(seed=1)  # same layout, other weights
    restarted = BackgroundCompiler(restarted_module, lambda bs: (x[:bs].clone(),), progress=False, choose=False)
    for key in ((1, 1), (1, 2)):
        restarted.request(key)
        assert restarted.wait(key, COMPILE_TIMEOUT), restarted.report()
    assert len(traced) == 2, "the restart traced nothing"
    assert all(state.endswith(", stored)") for state in restarted.report().values()), restarted.report()
    torch.testing.assert_close(restarted.ready((1, 1))(x), restarted_module(x))  # type: ignore[misc]
    restarted.close()

    store = GraphStore(restarted_module, graph_compiler.compile_options())
    found: dict[int, object] = {}

    def load_on(threads: int) -> None:
        torch.set_num_threads(threads)
        found[threads] = store.load((1, 2), (x,))

    for threads in (2, 1):
        caller = threading.Thread(target=load_on, args=(threads,))
        caller.start()
        caller.join()
    assert found[2] is not None, "the 2-thread graph loads on two threads"
    assert found[1] is None, "the 2-thread graph's guards refuse a 1-thread caller"
    # another layout is another file: nothing stored fits a wider module, nor one whose layer chose another kernel
    assert store.path((1, 1), (x,)) != GraphStore(Tiny(width=32), graph_compiler.compile_options()).path(
        (1, 1), (torch.randn(1, 32),))
    planned = Tiny(seed=1)
    planned.proj.plan = {1: "q8_0"}  # type: ignore[assignment]  # as a QuantLinear's kernel plan
    other = Tiny(seed=1)
    other.proj.plan = {1: "float32"}  # type: ignore[assignment]
    options = graph_compiler.compile_options()
    assert GraphStore(planned, options).path((1, 1), (x,)) != GraphStore(other, options).path((1, 1), (x,))
    assert GraphStore(planned, options).path((1, 1), (x,)) == GraphStore(planned, options).path((1, 1), (x,))


def test_the_graph_store_keeps_only_the_most_recently_used_files(tmp_path: Any) -> None:
    import os

    from ringserve.actors.engine.runner.graphs.graph_store import prune

    for i in range(5):
        path = tmp_path / f"{i}.graph"
        path.write_bytes(b"x")
        os.utime(path, (1000 + i, 1000 + i))
    os.utime(tmp_path / "0.graph", (2000, 2000))  # loaded lately
    (tmp_path / "notes.txt").write_text("not a graph")
    prune(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.graph", "3.graph", "4.graph", "notes.txt"]
