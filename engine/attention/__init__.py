"""Attention over the paged KV cache: metadata shared by every backend, and the backends."""

from kvpilot.engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
