"""Kernels: CPU C++ kernels, Triton, attention backends, quantized and float linears, the kernel plan and its
cache, sampling and LoRA ops."""
