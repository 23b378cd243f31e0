"""Mixtral: Mistral's attention with a mixture of experts in every layer (softmax router, top-k renormalised, no
shared expert). Its checkpoints name the block `block_sparse_moe` and an expert's gate/down/up `w1`/`w2`/`w3`."""

from ringserve.actors.engine.models.spec import ArchSpec, MoESpec, config_value

SPEC = ArchSpec(
    name="mixtral",
    moe=MoESpec(num_experts=lambda config: config_value(config, "num_local_experts", "num_experts"), inner=lambda config: config.intermediate_size,
                is_sparse=lambda config, layer: True),
    hf_renames=((r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
                (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj.")))
