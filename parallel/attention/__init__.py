"""Paged attention backends (torch reference; Triton on CUDA) behind one interface."""

from pdserve.parallel.attention.backend import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    select_backend,
)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "select_backend"]
