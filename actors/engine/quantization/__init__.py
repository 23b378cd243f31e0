"""Quantizing a loaded model's linears for the CPU kernels (`--quantization`): which layers, which format,
and the kernel plan each layer runs."""
