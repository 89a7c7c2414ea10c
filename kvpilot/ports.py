"""Free TCP ports for the servers kvpilot starts on loopback (tests, benchmarks, rendezvous).

Asking the kernel for port 0 returns one of its ephemeral ports, which stays free only until
someone else is given it: any outgoing connection takes its local port from the same range,
and so does every other ``bind(("127.0.0.1", 0))``. A server started seconds later on such a
port can fail with "address already in use" on a busy machine. The ports here come from below
the ephemeral range, which the kernel never hands out by itself.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 20000
"""Below this are the well-known and registered ports other software may expect to own, and
Ray's worker ports (10002-19999 by default), which a Ray head refuses to share with its own
ports (the rendezvous of a multi-node engine)."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's ``ip_local_port_range``; 32768-60999 where
    it cannot be read)."""
    try:
        with open(EPHEMERAL_RANGE_FILE, encoding="ascii") as file:
            low, high = (int(field) for field in file.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP port on ``host`` that nothing is bound to now, outside the ephemeral range
    (random among ``LOWEST_PORT`` up to it, or above it where it starts lower); the kernel's
    own pick when none of ``attempts`` tries is free.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    low, high = ephemeral_range()
    pool = range(LOWEST_PORT, low) if low - LOWEST_PORT >= 1000 else range(high + 1, 65536)
    for port in random.sample(pool, min(attempts, len(pool))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
