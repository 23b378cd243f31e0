"""The decode graph runner's batch-size ladder, padding and static buffers, checked on CPU in eager mode
(replay = the padded static-buffer forward run eagerly) against the plain eager forward; real CUDA-graph
capture only where CUDA is available (compiled CPU graphs: tests/engine/test_decode_graph_compile.py)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton case runs under the interpreter on CPU

from ringserve.actors.engine.config import EngineConfig  # noqa: E402
from ringserve.actors.engine.runner.graphs.decode_graph import DecodeGraphRunner, batch_size_ladder  # noqa: E402
from ringserve.actors.engine.scheduling.engine_core import EngineCore  # noqa: E402
from ringserve.actors.engine.runner.model_runner import ModelRunner  # noqa: E402
from ringserve.bus.messages import TokenizedRequest  # noqa: E402
from ringserve.kernels.attention import backend_names  # noqa: E402
from ringserve.kernels.triton import interpreter_enabled  # noqa: E402
from tests.engine_helpers import (  # noqa: E402
    assert_greedy_matches,
    engine_for,
    greedy,
    hf_greedy,
    run_to_completion,
    tokens_of,
)

EOS = 2
MAX_NEW = 8
PROMPT_LENGTHS = (3, 7, 1, 12, 5)



def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def with_graph_runner(engine: EngineCore, backend: str, max_bs: int) -> EngineCore:
    """Swap in a model runner whose decode goes through an eager-mode graph runner."""
    plan = dataclasses.replace(engine.execution, attention_backend=backend).with_graphs("eager", max_bs)
    engine.runner = ModelRunner(engine.runner.model, engine.pool, engine.table, plan)
    return engine


def test_ladder_is_powers_of_two_then_steps_of_eight() -> None:
    assert batch_size_ladder(160) == [1, 2, 4, 8] + list(range(16, 161, 8))
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(5) == [1, 2, 4, 5]
    assert batch_size_ladder(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError):
        batch_size_ladder(0)


def test_padding_and_fallback_decisions(hf: Any) -> None:
    engine = with_graph_runner(engine_for(hf, device="cpu", max_total_tokens=256), "torch", 12)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 12] and not graphs.captured
    assert [graphs.padded_size(n) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert graphs.can_run([1, 1, 1])
    assert not graphs.can_run([1, 4]), "mixed batches run eagerly"
    assert not graphs.can_run([1] * 13), "batches above the largest size run eagerly"
    assert not graphs.can_run([])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_replay_gives_the_eager_logits_and_kv(hf: Any, backend: str) -> None:
    if backend not in backend_names():
        pytest.skip(f"the {backend} backend is not installed")
    if backend == "triton" and not interpreter_enabled():
        pytest.skip("CPU tensors need Triton's interpreter; with CUDA the capture test below covers triton")
    engine = with_graph_runner(engine_for(hf, device="cpu", max_total_tokens=256), backend, 8)
    for i, p in enumerate(prompts()):
        assert engine.add_request(TokenizedRequest(f"r{i}", p, greedy(MAX_NEW))) is None
    engine.finish(batch := engine.schedule(), engine.launch(batch))  # prefill all five
    batch = engine.schedule()
    assert batch is not None and batch.num_decode == 5 and batch.num_tokens == 5  # padded to 8
    runner, graphs = engine.runner, engine.runner.graphs
    assert graphs is not None and graphs.can_run(batch.extend_lens)
    pool_before = engine.pool.k.clone()
    eager = runner._forward_eager(batch)
    pool_eager = engine.pool.k.clone()
    engine.pool.k.copy_(pool_before)
    replayed = graphs.replay(batch.rows, batch.starts)
    # the input ids were gathered from the device-side id table: each request's last sampled token, and the
    # scratch row's 0 for the three padding rows
    last = [r.ids[-1] for r in batch.reqs]
    assert graphs.inputs.input_ids[:8].tolist() == last + [0] * 3
    assert engine.table.ids[batch.rows, batch.starts].tolist() == last
    assert replayed.shape == eager.shape == (5, hf.config.vocab_size)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    scratch = engine.pool.scratch_slot
    torch.testing.assert_close(engine.pool.k[:, :scratch], pool_eager[:, :scratch], atol=1e-5, rtol=1e-5)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    engine.finish(batch, engine.launch(batch))
    engine.check_integrity()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_engine_with_graph_runner_matches_transformers(hf: Any, overlap: str) -> None:
    reference = [hf_greedy(hf, p, MAX_NEW, EOS) for p in prompts()]
    plain = engine_for(hf, device="cpu", max_total_tokens=256)
    # 5 requests: 4 replay, 5 eager; with overlap, a step's input tokens are sampled by the step still in flight
    graphed = with_graph_runner(engine_for(hf, device="cpu", max_total_tokens=256, overlap_schedule=overlap),
                                "torch", 4)
    reqs = [TokenizedRequest(f"r{i}", p, greedy(MAX_NEW, stop_token_ids=[EOS])) for i, p in enumerate(prompts())]
    out_plain = run_to_completion(plain, reqs)
    out_graphed = run_to_completion(graphed, reqs)
    for i, p in enumerate(prompts()):
        got = tokens_of(out_graphed[f"r{i}"])
        assert got == tokens_of(out_plain[f"r{i}"]), "graphs on and off give the same tokens"
        assert_greedy_matches(hf, p, reference[i], got)
    assert graphed.stats().kv_running_tokens == 0


def test_padding_rows_write_only_the_scratch_slot_under_overlap(hf: Any) -> None:
    """Three requests on a graph of size four, overlap on: the padding row runs on the scratch row (one key,
    the scratch slot), never on a request's row or slot, and the tokens and every request's KV are those of
    the same engine without graphs."""
    prompts3 = prompts()[:3]
    reqs = [TokenizedRequest(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(prompts3)]
    plain = engine_for(hf, device="cpu", max_total_tokens=256, overlap_schedule="on")
    graphed = with_graph_runner(engine_for(hf, device="cpu", max_total_tokens=256, overlap_schedule="on"),
                                "torch", 4)
    graphs, backend = graphed.runner.graphs, graphed.runner.backend
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    replays: list[tuple[int, list[int], list[int], list[int]]] = []
    prepare = backend.prepare_for_replay

    def recording(bs: int, info: Any) -> None:
        replays.append((bs, info.req_rows.tolist(), info.out_slots.tolist(), list(info.kv_lens_cpu)))
        prepare(bs, info)

    backend.prepare_for_replay = recording  # type: ignore[method-assign]
    out_plain, out_graphed = run_to_completion(plain, reqs), run_to_completion(graphed, reqs)
    assert graphed.counters.overlapped_steps > 0
    for i, p in enumerate(prompts3):
        assert tokens_of(out_graphed[f"r{i}"]) == tokens_of(out_plain[f"r{i}"])
        assert_greedy_matches(hf, p, hf_greedy(hf, p, MAX_NEW, None), tokens_of(out_graphed[f"r{i}"]))
    scratch_row, scratch_slot = graphed.table.scratch_row, graphed.pool.scratch_slot
    padded = [r for r in replays if r[0] == 4]
    assert padded, "three decoding requests replay the graph of size four"
    for bs, rows, slots, kv_lens in padded:
        assert rows[3] == scratch_row and slots[3] == scratch_slot and kv_lens[3] == 1
        assert scratch_row not in rows[:3] and scratch_slot not in slots[:3]
    torch.testing.assert_close(graphed.pool.k[:, :scratch_slot], plain.pool.k[:, :scratch_slot], atol=1e-5,
                               rtol=1e-5)
    graphed.check_integrity()


def test_graph_settings_come_from_the_engine_config() -> None:
    assert EngineConfig(device="cpu").graph_max_bs() == 160, "compiled decode graphs on a CPU"
    assert EngineConfig(device="cpu", disable_cuda_graph=True).graph_max_bs() == 0
    assert EngineConfig(device="cuda", disable_cuda_graph=True).graph_max_bs() == 0
    assert EngineConfig(device="cuda", cuda_graph_max_bs=64, max_running_requests=32).graph_max_bs() == 32
    assert "--cuda-graph-max-bs" in EngineConfig(cuda_graph_max_bs=8).to_argv()
    with pytest.raises(ValueError):
        EngineConfig(cuda_graph_max_bs=0)


def test_attention_backend_auto_is_torch_off_cuda() -> None:
    assert EngineConfig(device="cpu").resolved_attention_backend() == "torch"
    assert EngineConfig(device="cpu", attention_backend="triton").resolved_attention_backend() == "triton"
    expected = "triton" if "triton" in backend_names() else "torch"
    assert EngineConfig(device="cuda").resolved_attention_backend() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing CUDA graphs needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_captured_replay_matches_eager_on_cuda(hf: Any, backend: str) -> None:
    from tests.gpu.helpers import gpu_engine

    engine = gpu_engine(hf, backend, torch.float32, graphs=True, cuda_graph_max_bs=8)
    graphs = engine.runner.graphs
    assert isinstance(graphs, DecodeGraphRunner) and graphs.captured and sorted(graphs.graphs) == [1, 2, 4, 8]
    plain = gpu_engine(hf, backend, torch.float32, graphs=False)
    assert plain.runner.graphs is None
    reqs = [TokenizedRequest(f"r{i}", p, greedy(MAX_NEW)) for i, p in enumerate(prompts())]
    a, b = run_to_completion(engine, reqs), run_to_completion(plain, reqs)
    assert {k: tokens_of(v) for k, v in a.items()} == {k: tokens_of(v) for k, v in b.items()}
