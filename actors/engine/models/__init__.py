"""The models the engine runs: their modules (today Llama's), reading their weights from safetensors or GGUF,
GGUF block formats, and swapping weights in place."""
