"""``kvpilot drain``: the engine pod's preStop hook: wait until the engine has no request left.

The kubelet runs it in the engine container when the pod is deleted (a scale-down, a
rollout), before it sends SIGTERM; the pod's ``terminationGracePeriodSeconds`` bounds both.
It polls the engine's ``/metrics`` every ``--interval`` seconds and returns once
``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` has read 0 for ``--idle-seconds``
in a row (the router learns of the deletion through its watch, so a request may still arrive
just after the pod was marked), when the engine no longer answers (nothing to wait for), or
after ``--timeout`` seconds. It always exits 0: a failed hook would only be reported as an
Event and the kubelet would send SIGTERM anyway.

After SIGTERM the engine (uvicorn) stops accepting connections and lets the open ones
finish before the engine loop shuts down, so a stream that started during the idle window
still ends normally within the grace period.

Imports nothing heavy: it runs in every terminating engine pod.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def in_flight(text: str) -> float:
    """Requests running or waiting in an engine's ``/metrics`` text (summed over labels).

    Raises:
        ValueError: the text is not Prometheus text, or has neither metric.
    """
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in IN_FLIGHT:
                total += sample.value
                seen = True
    if not seen:
        raise ValueError(f"/metrics has none of {', '.join(IN_FLIGHT)}")
    return total


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the drain's flags."""
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the engine's base URL, from inside its pod (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout", type=float, default=290.0, help="give up after this many seconds"
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=2.0,
        help="how long the engine must stay without requests (default: %(default)s)",
    )
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls")


def run(args: argparse.Namespace) -> int:
    """Wait as the module docstring says; returns 0."""
    deadline = time.monotonic() + args.timeout
    idle_since: float | None = None
    waited_for = 0.0
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{args.url}/metrics", timeout=5) as answer:
                count = in_flight(answer.read().decode())
        except (urllib.error.URLError, OSError) as exc:
            print(f"kvpilot drain: the engine does not answer ({exc}); done", file=sys.stderr)
            return 0
        except ValueError as exc:
            print(f"kvpilot drain: {exc}; done", file=sys.stderr)
            return 0
        now = time.monotonic()
        if count > 0:
            idle_since = None
            waited_for = max(waited_for, count)
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= args.idle_seconds:
            print(f"kvpilot drain: idle (had up to {waited_for:g} requests in flight); done")
            return 0
        time.sleep(args.interval)
    print(f"kvpilot drain: still busy after {args.timeout:g} s; the kubelet takes over")
    return 0
