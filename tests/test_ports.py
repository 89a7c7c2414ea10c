"""``kvpilot.ports.free_port``: loopback ports that no outgoing connection or ``bind(0)`` can be
handed between the pick and the server's own bind (outside the kernel's ephemeral range)."""

from __future__ import annotations

import socket

from kvpilot import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_free():
    low, high = ports.ephemeral_range()
    picked = {ports.free_port() for _ in range(20)}
    for port in picked:
        assert ports.LOWEST_PORT <= port < low or port > high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free
    assert len(picked) > 1  # random, so parallel test processes rarely meet


def test_the_range_file_decides_and_a_missing_one_means_linuxs_default(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t40000\n")  # nothing below it to take: above it then
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(range_file))
    assert ports.ephemeral_range() == (1024, 40000)
    assert all(ports.free_port() > 40000 for _ in range(10))
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert ports.ephemeral_range() == (32768, 60999)


def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        busy, free = taken.getsockname()[1], ports.free_port()
        # The random order tries the taken port first, then a free one.
        monkeypatch.setattr(ports.random, "sample", lambda pool, k: [busy, free])
        assert ports.free_port() == free
