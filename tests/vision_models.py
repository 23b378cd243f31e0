"""Tiny random-weight vision-language models built with transformers' own config and model classes, saved with
their processors, for comparing our engine (and the ring) with transformers on images.

Kinds: `llava` (a CLIP tower, `vision_feature_layer` -2, the "default" strategy dropping CLS, the 2-layer GELU
projector, over a Llama text model) and `gemma3` (a SigLIP tower, Gemma 3's avg-pool/RMSNorm projector, over a
Gemma 3 text model with 6-token sliding windows, so an image's tokens cross them). Images are 32x32: LLaVA makes 16
image tokens of one (4x4 patches of 8 pixels), Gemma 3 16 as well (8x8 patches of 4 pixels pooled 2x2). And
`qwen2_vl`, `qwen2_5_vl` (dynamic resolution: 4-pixel patches merged 2x2, so a 32x32 image makes 16 tokens and a
40x24 one 15; a Qwen2 text model with M-RoPE; Qwen2.5-VL's tower windowed), whose processor is built without its
video processor (actors/tokenizer/processor_loader.py: that needs torchvision).

The tokenizer is SmolLM2's with the image tokens added, and a ChatML template that takes content parts
(`{"type": "image"}` renders the processor's image placeholder), set on the tokenizer and the processor alike.
Weights are drawn with std 0.3 (norm weights near identity) so greedy choices are not near-ties, as in
tests/model_families.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KINDS = ("llava", "gemma3", "qwen2_vl", "qwen2_5_vl")
QWEN_KINDS = ("qwen2_vl", "qwen2_5_vl")
IMAGE_SIZE = 32
IMAGE_TOKENS = 16  # image tokens per 32x32 image, every kind
# the placeholder the chat template writes for an image part, per kind (the processor expands it)
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PLACEHOLDER = {"llava": "<image>", "gemma3": "<start_of_image>", "qwen2_vl": QWEN_PLACEHOLDER,
               "qwen2_5_vl": QWEN_PLACEHOLDER}
QWEN_SPECIAL = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
SPECIAL = {"llava": {"image_token": "<image>"},
           "gemma3": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                      "eoi_token": "<end_of_image>"},
           "qwen2_vl": QWEN_SPECIAL, "qwen2_5_vl": QWEN_SPECIAL}
# Qwen2-VL / Qwen2.5-VL: 4-pixel patches merged 2x2, so any image whose sides are multiples of 8 (between the
# processor's pixel bounds) keeps its size: 32x32 makes 8x8 patches, 16 image tokens; 40x32 makes 20
QWEN_PIXELS = {"min_pixels": 8 * 8, "max_pixels": 64 * 64}


def chat_template(kind: str) -> str:
    """ChatML over string or content-part messages; an image part renders as `PLACEHOLDER[kind]`."""
    image = PLACEHOLDER[kind]
    return (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] in ('image', 'image_url') %}{{ '" + image + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer(kind: str) -> Any:
    """SmolLM2's tokenizer with `kind`'s image tokens added (named as its processor reads them) and the template."""
    import tempfile

    from transformers import AutoTokenizer

    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    with tempfile.TemporaryDirectory() as directory:
        load_tokenizer(resolve_model("SmolLM2-135M-Instruct")).save_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory, extra_special_tokens=SPECIAL[kind])
    tokenizer.chat_template = chat_template(kind)
    return tokenizer


def _config(kind: str, tokenizer: Any) -> Any:
    common: dict[str, Any] = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=IMAGE_SIZE)
    if kind in QWEN_KINDS:
        return _qwen_config(kind, tokenizer, common)
    if kind == "llava":
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

        return LlavaConfig(vision_config=CLIPVisionConfig(**vision, patch_size=8, projection_dim=32),
                           text_config=LlamaConfig(**common, tie_word_embeddings=False),
                           image_token_id=tokenizer.image_token_id, image_seq_length=IMAGE_TOKENS,
                           vision_feature_layer=-2, vision_feature_select_strategy="default",
                           tie_word_embeddings=False)
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(**common, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                            tie_word_embeddings=False,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return Gemma3Config(vision_config=SiglipVisionConfig(**vision, patch_size=4, vision_use_head=False),
                        text_config=text, mm_tokens_per_image=IMAGE_TOKENS,
                        image_token_index=tokenizer.image_token_id, boi_token_index=tokenizer.boi_token_id,
                        eoi_token_index=tokenizer.eoi_token_id, tie_word_embeddings=False)


def _qwen_config(kind: str, tokenizer: Any, common: dict[str, Any]) -> Any:
    """Qwen2-VL / Qwen2.5-VL over a 3-layer text model with M-RoPE (`mrope_section` over its 8 frequencies); 2.5's
    tower attends within 16-pixel windows (2x2 merged patches) in blocks 0 and 2, over the whole image in 1."""
    tokens = dict(image_token_id=tokenizer.image_token_id, video_token_id=tokenizer.video_token_id,
                  vision_start_token_id=tokenizer.vision_start_token_id,
                  vision_end_token_id=tokenizer.vision_end_token_id)
    text = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                tie_word_embeddings=False)
    vision: dict[str, Any] = dict(depth=3, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                                  in_channels=3)
    if kind == "qwen2_vl":
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig(text_config=text, vision_config=dict(vision, embed_dim=32, hidden_size=64, mlp_ratio=2),
                             tie_word_embeddings=False, **tokens)
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, hidden_size=32, out_hidden_size=64,
                                                                 intermediate_size=48, window_size=16,
                                                                 fullatt_block_indexes=[1]),
                            tie_word_embeddings=False, **tokens)


def tiny_processor(kind: str, tokenizer: Any | None = None) -> Any:
    """`kind`'s processor (image processor, the tokenizer, the chat template) for 32x32 images."""
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer(kind)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    if kind in QWEN_KINDS:
        from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from ringserve.actors.tokenizer.processor_loader import images_only

        images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, **QWEN_PIXELS)
        processor = images_only(Qwen2VLProcessor if kind == "qwen2_vl" else Qwen2_5_VLProcessor)  # no torchvision
        return processor(images, tokenizer, chat_template=chat_template(kind))
    if kind == "llava":
        from transformers import LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=size)
        return LlavaProcessor(images, tokenizer, patch_size=8, vision_feature_select_strategy="default",
                              chat_template=chat_template(kind), num_additional_image_tokens=1)
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3Processor(Gemma3ImageProcessorPil(size=size), tokenizer, chat_template=chat_template(kind),
                           image_seq_length=IMAGE_TOKENS)


def tiny_hf_vlm(kind: str, seed: int = 0) -> tuple[Any, Any]:
    """`(model, processor)`: `kind`'s tiny random model as transformers builds it (eager attention), in eval mode."""
    from transformers import AutoModelForImageTextToText

    processor = tiny_processor(kind)
    config = _config(kind, processor.tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's RMSNorms scale by 1 + weight, LayerNorms by weight (+ bias)
                offset = name.endswith("weight") and (kind != "gemma3" or "vision_tower" in name)
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if offset else 0.0))
            else:
                p.normal_(0.0, 0.3)
    return model.eval(), processor


def save_tiny_vlm(kind: str, directory: Path, seed: int = 0) -> Path:
    """Save `kind`'s tiny model (safetensors, config.json) with its processor (tokenizer, image processor, chat
    template) into `directory`; `ringserve serve --model directory` serves it."""
    model, processor = tiny_hf_vlm(kind, seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    processor.tokenizer.save_pretrained(directory)
    return directory


def random_image(seed: int, size: int = IMAGE_SIZE, height: int | None = None) -> Any:
    """A deterministic random RGB PIL image (`size` wide, `height` or `size` high)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height or size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def process(processor: Any, images: list[Any], text: str = "Describe this.") -> dict[str, Any]:
    """The processor's tensors for one chat turn with `images` then `text` (generation prompt added)."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    return dict(processor(text=prompt, images=images or None, return_tensors="pt"))
