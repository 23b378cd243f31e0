"""Attention backends: the abstract contract and the plain-torch paged reference implementation."""

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from kernels.attention.torch_paged import TorchPagedBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedBackend"]
