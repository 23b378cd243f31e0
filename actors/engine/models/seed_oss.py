"""Seed-OSS (ByteDance): Llama's layer with q/k/v biases (`attention_bias`) and an output projection bias of its
own switch (`attention_out_bias`)."""

from typing import Any

from ringserve.actors.engine.models.spec import ArchSpec


def _out_bias(config: Any) -> bool:
    return bool(getattr(config, "attention_out_bias", False))


SPEC = ArchSpec(name="seed_oss", o_bias=_out_bias, fused_cpu_decode=True)
