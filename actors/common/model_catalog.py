"""The model catalog: which architecture family serves a checkpoint, by config.json's `architectures` (or
`model_type`) or a GGUF's `general.architecture`, and what the launcher, the tokenizer and the engine read of a
family without building it: whether it takes images, whether it has experts, a config's context length.

This module needs no torch: the launcher checks a model here before any actor starts. Each family's layers are
declared by its module in actors/engine/models/ (its `ArchSpec`, `spec_of`). Adding an architecture is a family
file there plus a row below (docs/models.md says how).
"""

from __future__ import annotations

from typing import Any

# family module -> the config.json `architectures`, `model_type`s and GGUF `general.architecture`s it serves
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "llama": (("LlamaForCausalLM",), ("llama",), ("llama",)),
    "mistral": (("MistralForCausalLM",), ("mistral",), ()),  # llama.cpp writes Mistral GGUFs as "llama"
    "qwen2": (("Qwen2ForCausalLM",), ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text"), ("qwen2",)),  # + VL text models
    "qwen3": (("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",)),
    "gemma2": (("Gemma2ForCausalLM",), ("gemma2",), ("gemma2",)),
    "gemma3": (("Gemma3ForCausalLM",), ("gemma3_text",), ("gemma3",)),
    "phi3": (("Phi3ForCausalLM",), ("phi3",), ("phi3",)),
    "mixtral": (("MixtralForCausalLM",), ("mixtral",), ()),  # llama.cpp writes Mixtral GGUFs as "llama"
    "qwen2_moe": (("Qwen2MoeForCausalLM",), ("qwen2_moe",), ("qwen2moe",)),
    "qwen3_moe": (("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",)),
    "deepseek_v2": (("DeepseekV2ForCausalLM",), ("deepseek_v2",), ()),  # transformers reads no DeepSeek GGUF
    "deepseek_v3": (("DeepseekV3ForCausalLM",), ("deepseek_v3",), ()),
    "smollm3": (("SmolLM3ForCausalLM",), ("smollm3",), ()),
    "olmo2": (("Olmo2ForCausalLM", "Olmo3ForCausalLM"), ("olmo2", "olmo3"), ()),
    "exaone4": (("Exaone4ForCausalLM",), ("exaone4",), ()),
    "seed_oss": (("SeedOssForCausalLM",), ("seed_oss",), ()),
    "ernie4_5": (("Ernie4_5ForCausalLM",), ("ernie4_5",), ()),
    "glm4_moe": (("Glm4MoeForCausalLM",), ("glm4_moe",), ()),
    # vision-language: a vision tower over the text family of their text_config (models/vision/)
    "llava": (("LlavaForConditionalGeneration",), ("llava",), ()),
    "gemma3_vision": (("Gemma3ForConditionalGeneration",), ("gemma3",), ()),
    "qwen2_vl": (("Qwen2VLForConditionalGeneration",), ("qwen2_vl",), ()),
    "qwen2_5_vl": (("Qwen2_5_VLForConditionalGeneration",), ("qwen2_5_vl",), ()),
}
# the vision-language families (a vision tower over a text family: models/vision/ builds them)
VISION_FAMILIES = ("llava", "gemma3_vision", "qwen2_vl", "qwen2_5_vl")
# the families whose layers include mixture-of-experts ones (their `ArchSpec.moe`)
EXPERT_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe")


class UnsupportedArchitecture(ValueError):
    """A checkpoint of an architecture no family here serves."""


def supported_architectures() -> list[str]:
    """Every config.json architecture name we serve, for messages and docs."""
    return [name for names, _, _ in FAMILIES.values() for name in names]


def family_of(config: Any) -> str:
    """The family serving `config` (a config object or config.json's dict); UnsupportedArchitecture names what
    the config is and what we serve."""
    read = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    architectures = read("architectures") or []
    model_type = read("model_type")
    for family, (names, model_types, _) in FAMILIES.items():
        if any(a in names for a in architectures) or (not architectures and model_type in model_types):
            return family
    named = ", ".join(map(str, architectures)) or f"model_type {model_type!r}"
    raise UnsupportedArchitecture(f"unsupported architecture {named}; served are: "
                                  f"{', '.join(supported_architectures())}")


def family_of_gguf(architecture: str) -> str:
    """The family serving a GGUF whose `general.architecture` is `architecture`."""
    for family, (_, _, gguf_names) in FAMILIES.items():
        if architecture in gguf_names:
            return family
    served = sorted(a for _, _, names in FAMILIES.values() for a in names)
    raise UnsupportedArchitecture(f"unsupported GGUF architecture {architecture!r}; served are: {', '.join(served)}")


def image_token_id(config: Any) -> int | None:
    """The token a vision-language checkpoint's processor repeats for each image's embeddings (config.json's
    `image_token_id`, or `image_token_index`); None for a text-only model, which takes no images."""
    read = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    if family_of(config) not in VISION_FAMILIES:
        return None
    value = read("image_token_id")
    return int(value if value is not None else read("image_token_index"))


def context_length(config: Any) -> int:
    """The longest sequence a (text) config's model takes: its `max_position_embeddings`, or its original context
    times the factor of `dynamic` rotary scaling, which exists to go past it (as vLLM and SGLang serve it)."""
    length = int(config.max_position_embeddings)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and params.get("rope_type", params.get("type")) == "dynamic":
        original = params.get("original_max_position_embeddings") or length
        return max(length, int(original * params["factor"]))
    return length


def family_has_experts(family: str) -> bool:
    """Whether `family` declares mixture-of-experts layers."""
    return family in EXPERT_FAMILIES
