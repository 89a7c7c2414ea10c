"""Attention over the paged KV cache: metadata shared by every backend, and the backends."""

from kvpilot.engine.attention.backends import AttentionBackend, get_attention_backend
from kvpilot.engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
