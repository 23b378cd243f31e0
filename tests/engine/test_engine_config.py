"""EngineConfig is the single definition of the engine's flags: parse, validate, pass on to a scheduler."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from ringserve.actors.engine.config import EngineConfig


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    return EngineConfig.from_args(parser.parse_args(argv))


def test_flags_round_trip_through_the_launcher_argv() -> None:
    config = parse(["--chunked-prefill-size", "64", "--disable-radix-cache", "--schedule-policy", "lpm",
                    "--max-total-tokens", "4096", "--dtype", "float32", "--mem-fraction-static", "0.2"])
    assert (config.chunked_prefill_size, config.disable_radix_cache, config.schedule_policy) == (64, True, "lpm")
    assert parse(config.to_argv()) == config
    assert EngineConfig().to_argv() == []


@pytest.mark.parametrize("argv", [["--attention-backend", "nope"], ["--dtype", "int3"], ["--quantization", "int3"],
                                  ["--schedule-policy", "random"]])
def test_unknown_choices_are_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(argv)


@pytest.mark.parametrize("field, value", [("max_running_requests", 0), ("max_total_tokens", -1),
                                          ("mem_fraction_static", 1.5), ("attention_backend", "nope")])
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_auto_device_and_dtype_and_pool_size() -> None:
    config = EngineConfig(device="cpu")
    assert config.resolved_dtype() == "float32"
    assert EngineConfig(max_total_tokens=1000).kv_pool_tokens(bytes_per_token=10**6, context_length=100) == 1000
    # automatic sizing is capped by what max_running_requests full-context requests could use
    assert EngineConfig(max_running_requests=2).kv_pool_tokens(bytes_per_token=1, context_length=100) == 200
    # rounded down to a power of two, so a compiled graph (the pool's shape is part of it) keeps hitting
    # Inductor's cache while the memory moves between starts (tests/engine/test_kv_pool_size.py)
    from ringserve.actors.common.memory_limits import MemoryBudget
    from ringserve.actors.engine.config import POOL_ROUNDING

    sizes = {EngineConfig(device="cpu").kv_pool_tokens(
        bytes_per_token=46080, context_length=8192, memory=MemoryBudget(free, "host MemAvailable", free))
        for free in (23_821_316_096, 23_800_000_000, 23_780_000_000)}
    assert sizes == {32768} and 32768 % POOL_ROUNDING == 0, sizes  # 51695, 51649 and 51605 unrounded


def test_scheduler_and_serve_help_list_the_engine_flags() -> None:
    for module in ("ringserve.actors.scheduler", "ringserve.actors.launcher.cli"):
        argv = [sys.executable, "-m", module] + (["serve", "--help"] if module.endswith("cli") else ["--help"])
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        for flag in ("--attention-backend", "--chunked-prefill-size", "--disable-radix-cache", "--schedule-policy",
                     "--device", "--dtype", "--quantization", "--mem-fraction-static", "--overlap-schedule"):
            assert flag in out, (module, flag)


def test_overlap_schedule_is_on_for_cuda_only_unless_asked() -> None:
    assert not EngineConfig(device="cpu").overlap_enabled()
    assert EngineConfig(device="cuda").overlap_enabled()
    assert EngineConfig(device="cpu", overlap_schedule="on").overlap_enabled()
    assert not EngineConfig(device="cuda", overlap_schedule="off").overlap_enabled()
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig(overlap_schedule="sometimes")


@pytest.mark.parametrize("argv", [
    ["--lora-modules", "a1=/x", "a2=/y"],  # vLLM's form: several arguments after one flag
    ["--lora-modules", "a1=/x,a2=/y"],  # ours: one argument, comma-separated
    ["--lora-modules", "a1=/x", "--lora-modules", "a2=/y"],  # repeated
    ["--lora-modules", '{"name": "a1", "path": "/x"}', "a2=/y"],  # vLLM's JSON objects, one an argument
])
def test_lora_modules_take_vllms_forms(argv: list[str]) -> None:
    config = parse(argv)
    assert config.lora_module_map() == {"a1": "/x", "a2": "/y"} and config.lora_enabled()
    assert parse(config.to_argv()) == config  # the scheduler's command line carries each argument as given
    assert EngineConfig(lora_modules="a1=/x,a2=/y").lora_module_map() == config.lora_module_map()  # Python callers


def test_lora_modules_json_names_its_base_model() -> None:
    config = parse(["--lora-modules", '{"name": "a1", "path": "/x", "base_model_name": "m"}', "a2=/y"])
    assert config.lora_module_map() == {"a1": "/x", "a2": "/y"} and config.lora_base_models() == {"a1": "m"}


@pytest.mark.parametrize("argument, message", [
    ('{"name": "a", "path": "/x", "base_model": "m"}', "base_model"),  # a key we do not take
    ('{"name": "a", "path": "/x", "base_model_name": 3}', "base_model_name is a string"),
    ('{"name": "a"}', "name and a path"), ('{"name": "a", "path": /x}', "not a JSON object"),
    ("a", "name=path"), ("a=/x,a=/y", "twice"),
])
def test_lora_modules_refuse_what_they_cannot_serve(argument: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(["--lora-modules", argument])


def test_vllm_and_sglang_spellings_of_shared_flags() -> None:
    config = parse(["--dtype", "half", "--speculative-algorithm", "NGRAM"])
    assert (config.dtype, config.speculative_algorithm) == ("float16", "ngram")
    assert parse(["--dtype", "float"]).dtype == EngineConfig(dtype="float").dtype == "float32"
