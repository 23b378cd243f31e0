"""Model families and weights against transformers: architectures, MoE, MLA, rotaries, GGUF and quantized
checkpoints, LoRA adapters, embeddings, chat templates, the catalog and the hub cache."""
