"""Consistent hashing of a request key onto replicas (Karger et al. 1997), the fallback order of
the router when it cannot tokenize a prompt (KubeAI's method: hash of the prompt's prefix).

Pure: no I/O, no state beyond the ring built from the replica names.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

VIRTUAL_NODES = 64
"""Points per replica on the ring: enough for an even split among a handful of replicas."""


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A ring of ``VIRTUAL_NODES`` points per replica name.

    Args:
        names: the replicas (any order; the ring depends only on the set).
        virtual_nodes: points per replica (> 0).

    Raises:
        ValueError: no names, or ``virtual_nodes`` < 1.
    """

    def __init__(self, names: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        if not names:
            raise ValueError("HashRing needs at least one replica")
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.names = sorted(set(names))
        ring = sorted(
            (_point(f"{name}#{i}".encode()), name)
            for name in self.names
            for i in range(virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [name for _, name in ring]

    def order(self, key: bytes) -> list[str]:
        """Every replica once, in the order a clockwise walk from ``key``'s point meets them:
        the first is the key's owner, the next ones take over when it is full or down."""
        start = bisect.bisect(self._points, _point(key))
        seen: list[str] = []
        for i in range(len(self._owners)):
            name = self._owners[(start + i) % len(self._owners)]
            if name not in seen:
                seen.append(name)
                if len(seen) == len(self.names):
                    break
        return seen
