"""Print pyproject.toml's pinned runtime dependencies, one a line, for the images' pip installs.

The images install dependencies in a layer of their own, before the sources, so that a source
change does not reinstall torch; pins stay in pyproject.toml alone, this only reads them.
With --operator, the engine's model runtime, serving stack and GPU kernels are left out: the
operator sizes models from their configs and never serves one. It reads GGUF metadata (the
built-in default model's config) with the ``gguf`` package, which needs numpy but not torch.

Usage: python hack/requirements.py [--operator] [PYPROJECT] > requirements.txt
"""

from __future__ import annotations

import argparse
import re
import tomllib

# Distributions only the engine imports (each is also its import name): the operator must start
# and size the built-in model without them (tests/chart/test_images.py blocks these imports).
ENGINE_ONLY = frozenset(
    {"torch", "triton", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn"}
)


def requirements(pyproject: dict, *, operator: bool = False) -> list[str]:
    """The requirement strings of ``pyproject``'s ``[project] dependencies``.

    ``operator``: only those the operator needs (ENGINE_ONLY left out).
    Raises KeyError when the file has no ``[project] dependencies``.
    """
    listed = pyproject["project"]["dependencies"]
    return [r for r in listed if not (operator and _name(r) in ENGINE_ONLY)]


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", nargs="?", default="pyproject.toml")
    parser.add_argument("--operator", action="store_true", help="leave out the engine's stack")
    args = parser.parse_args()
    with open(args.pyproject, "rb") as f:
        print("\n".join(requirements(tomllib.load(f), operator=args.operator)))


if __name__ == "__main__":
    main()
