"""Tags that arrive in pieces: what a streaming parser (tool calls, reasoning) holds back.

A tag such as ``<tool_call>`` or ``</think>`` is several tokens for most tokenizers, so one
delta may end with its first characters; the parser keeps them until the next delta shows
whether the tag completes. Imports nothing but the standard library: the CLI reads the parsers'
names through modules that import this one, also where the server's stack is not installed.
"""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (0 if none), in characters:
    text a streaming parser holds back, since the next delta may complete the tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
