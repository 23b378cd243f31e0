"""The thread tuner runs each step size on the thread count measured cheaper, and keeps re-checking."""

from __future__ import annotations

import pytest
import torch

from ringserve.actors.engine.runner.graphs.thread_tuner import EXPLORE_RUN, ThreadTuner
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import engine_for, greedy, run_to_completion, tiny_hf_llama, tokens_of


def serve(tuner: ThreadTuner, num_tokens: int, cost: dict[int, float], steps: int) -> list[int]:
    """Run `steps` steps of `num_tokens` tokens whose time per token is `cost[threads]`; the counts chosen."""
    chosen = []
    for _ in range(steps):
        threads = tuner.choose(num_tokens)
        tuner.record(num_tokens, threads, cost[threads] * num_tokens)
        chosen.append(threads)
    return chosen


def test_each_step_size_learns_its_own_thread_count() -> None:
    tuner = ThreadTuner((1, 2), large_from_tokens=64, explore_every=25, warmup=2)
    small = serve(tuner, 1, {1: 0.010, 2: 0.014}, 100)  # batch 1: one thread cheaper
    large = serve(tuner, 32, {1: 0.004, 2: 0.003}, 100)  # 32 streams: two threads cheaper
    # both tried first, each once more than the warm-up: the first step after a switch pays for it, uncounted
    assert small[:6] == [1, 1, 1, 2, 2, 2] and sorted(large[:6]) == [1, 1, 1, 2, 2, 2]
    assert small[6:].count(1) > 70 and large[6:].count(2) > 70
    assert small[6:].count(2) >= EXPLORE_RUN and large[6:].count(1) >= EXPLORE_RUN, "re-tried now and then"
    assert tuner.preferred() == {"1-1 tokens": 1, "32-63 tokens": 2}


def test_a_retry_runs_several_steps_and_the_switching_step_is_not_counted() -> None:
    tuner = ThreadTuner((1, 2), large_from_tokens=64, explore_every=20, warmup=1)
    chosen = []
    for _ in range(63):  # (ends with a whole re-try) the first step after each switch is slow: counted, it would make every switch lose
        threads = tuner.choose(1)
        switched = bool(chosen) and threads != chosen[-1]
        tuner.record(1, threads, (0.050 if switched else {1: 0.010, 2: 0.008}[threads]))
        chosen.append(threads)
    assert tuner.preferred() == {"1-1 tokens": 2}
    runs = "".join(map(str, chosen[4:])).split("2")
    assert all(len(run) in (0, EXPLORE_RUN) for run in runs), chosen  # re-tries of one thread: 4 in a row


def test_it_follows_a_change_in_which_count_is_cheaper() -> None:
    tuner = ThreadTuner((1, 2), large_from_tokens=64, explore_every=10, warmup=1)
    serve(tuner, 8, {1: 0.010, 2: 0.005}, 20)
    assert tuner.preferred() == {"8-15 tokens": 2}
    later = serve(tuner, 8, {1: 0.010, 2: 0.020}, 60)  # other load now takes the second core
    assert tuner.preferred() == {"8-15 tokens": 1} and later[-10:].count(1) >= 6


def test_prefill_chunks_try_each_count_once_and_keep_the_cheaper() -> None:
    """Issue 53: on a busy host a chunk on two threads took 5x as long as on one; a re-try costs a whole
    chunk, so it lasts one step, and the step after a switch counts."""
    tuner = ThreadTuner((1, 2), large_from_tokens=64, explore_every=20)
    busy = serve(tuner, 512, {1: 0.014, 2: 0.072}, 40)
    assert busy[:2] == [1, 2] and busy[2:].count(1) == 38 - busy[2:].count(2) and busy[2:].count(2) == 2
    assert "2" * 2 not in "".join(map(str, busy[2:])), busy  # each re-try of two threads is one step
    quiet = serve(tuner, 64, {1: 0.004, 2: 0.002}, 20)  # its own size, learned apart
    assert quiet[:2] == [1, 2] and quiet[2:].count(1) == 1  # the one re-try, at the group's 20th step
    assert tuner.preferred() == {"64-127 tokens": 2, "512-1023 tokens": 1}
    with pytest.raises(ValueError):
        ThreadTuner((0, 2), large_from_tokens=64)


def test_the_model_runner_times_its_steps_for_the_tuner() -> None:
    hf = tiny_hf_llama()
    plain = run_to_completion(engine_for(hf), [TokenizedRequest("r", [5, 9, 2], greedy(12))])
    engine = engine_for(hf)
    engine.runner.set_thread_policy((1, 2), large_from_tokens=64)
    before = torch.get_num_threads()
    try:
        tuned = run_to_completion(engine, [TokenizedRequest("r", [5, 9, 2], greedy(12))])
    finally:
        torch.set_num_threads(before)
    assert tokens_of(tuned["r"]) == tokens_of(plain["r"])
    assert engine.runner.thread_tuner is not None
    assert engine.runner.thread_tuner.preferred().keys() == {"1-1 tokens"}  # 11 decode steps, both counts tried


def test_forgetting_tries_every_count_again() -> None:
    """What the tuner learnt before a decode graph was ready timed the eager forward: it starts over."""
    tuner = ThreadTuner((1, 2), large_from_tokens=64, explore_every=50, warmup=2)
    serve(tuner, 1, {1: 0.010, 2: 0.030}, 20)  # eager, under a compile's load: one thread cheaper
    assert tuner.preferred() == {"1-1 tokens": 1}
    tuner.forget()
    assert tuner.preferred() == {}
    after = serve(tuner, 1, {1: 0.012, 2: 0.008}, 20)  # the compiled graph: two threads cheaper
    # one thread ran last: no switch to discount before its samples, then two (the first uncounted)
    assert after[:5] == [1, 1, 2, 2, 2] and after[5:] == [2] * 15
    assert tuner.preferred() == {"1-1 tokens": 2}


def test_the_model_runner_makes_the_tuner_forget_when_a_decode_graph_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGSERVE_GRAPH_FALLBACK", "eager")  # the test demotes a graph on purpose
    engine = engine_for(tiny_hf_llama())
    runner = engine.runner
    runner.set_thread_policy((1, 2), large_from_tokens=64)
    assert runner.graphs is not None and runner.graphs.compiler is not None  # compile mode, nothing compiled
    before = torch.get_num_threads()
    try:
        run_to_completion(engine, [TokenizedRequest("a", [5, 9, 2], greedy(12))])
        assert runner.thread_tuner.preferred().keys() == {"1-1 tokens"}
        runner.graphs.compiler.demote((1, 1), RuntimeError("a graph settles"))  # what some size runs changed
        run_to_completion(engine, [TokenizedRequest("b", [5, 9, 2], greedy(2))])  # one decode step: relearning
        assert runner.thread_tuner.preferred() == {}
    finally:
        torch.set_num_threads(before)


def test_a_chunk_runs_on_more_threads_only_when_they_are_clearly_cheaper() -> None:
    """A wrong choice of every core costs a busy host several chunks' time: a narrow lead is not enough."""
    tuner = ThreadTuner((1, 2), large_from_tokens=64, explore_every=1000)
    assert serve(tuner, 256, {1: 0.010, 2: 0.0095}, 10)[2:] == [1] * 8
    assert serve(tuner, 1024, {1: 0.010, 2: 0.006}, 10)[2:] == [2] * 8
