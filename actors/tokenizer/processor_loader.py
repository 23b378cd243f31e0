"""A vision-language model's processor for images, loadable without torchvision.

transformers builds some processors (Qwen2-VL's, Qwen2.5-VL's) with a video processor, which needs torchvision;
ringserve takes images only and does not install it. `load_processor` loads the model's processor as
`AutoProcessor` does and, when only its video part cannot be built, the same processor class without it
(`images_only`): its image processor, tokenizer and chat template, the same outputs for images.
"""

from __future__ import annotations

import functools
from typing import Any


def load_processor(directory: str) -> Any:
    """The processor of the model in `directory`: `AutoProcessor`'s, or its class without a video processor when
    that one needs a library that is not installed."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(directory)
    except (ImportError, OSError) as exc:  # torchvision missing, or no video processor config saved
        if "video" not in str(exc).lower():
            raise
        return images_only(processor_class(directory)).from_pretrained(directory)


def processor_class(directory: str) -> type:
    """The processor class transformers maps the model's `model_type` to."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    return getattr(transformers, PROCESSOR_MAPPING_NAMES[AutoConfig.from_pretrained(directory).model_type])


@functools.cache
def images_only(cls: type) -> type:
    """`cls` (a processor taking `image_processor, tokenizer, video_processor`) without its video processor: the
    same name (so what it saves loads as `cls`), sub-processors the image processor and tokenizer only."""

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__doc__": f"{cls.__name__} for images only (no video processor)."})
