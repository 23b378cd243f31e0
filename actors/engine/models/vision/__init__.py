"""Vision-language models: a vision tower and a projector whose image embeddings replace a prompt's image tokens
in one of the registry's text models (`VisionCausalLM`, a `CausalLM` of the text config). LLaVA (CLIP or SigLIP
tower, 2-layer GELU projector) and Gemma 3 (SigLIP, average-pool and RMSNorm projector, image tokens attending to
each other both ways)."""
