"""The ``kvpilot`` command line: one subcommand per entry point.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int | None``. Those modules import nothing heavy (torch, kopf) at module level, so
``kvpilot --help`` stays fast; the work is imported inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvpilot.argv import dash_flag_names, expand_config_file

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": (
        "kvpilot.engine.entrypoints.generate_cli",
        "generate text offline with the engine",
    ),
    "serve": ("kvpilot.engine.server.cli", "run the OpenAI-compatible server"),
    "plan": (
        "kvpilot.operator.plan_cli",
        "size a model for a GPU type (tensor parallel, KV capacity)",
    ),
    "operator": ("kvpilot.operator.main", "run the Kubernetes operator (kopf)"),
    "ray-node": (
        "kvpilot.engine.entrypoints.ray_node",
        "run a Ray head or worker of a multi-node replica (LeaderWorkerSet pods)",
    ),
    "router": (
        "kvpilot.router.cli",
        "route OpenAI requests across engine replicas (prefix- and load-aware)",
    ),
    "drain": (
        "kvpilot.operator.drain",
        "wait until an engine has no request in flight (the engine pod's preStop hook)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every subcommand's arguments."""
    parser = argparse.ArgumentParser(prog="kvpilot", description=__doc__.splitlines()[0])
    from kvpilot import __version__

    parser.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        # No abbreviated flags: --max-model would otherwise set --max-model-len, past the
        # operator's check of the flags it manages (spec.engine.extraArgs).
        sp = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand.

    As vLLM's command line: flag names may be spelled with underscores, and a subcommand's
    ``--config FILE`` (YAML) stands for the flags in it (``kvpilot.argv``).
    """
    parser = build_parser()
    argv = dash_flag_names(sys.argv[1:] if argv is None else argv)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    if argv and argv[0] in subparsers.choices:
        try:
            argv = argv[:1] + expand_config_file(argv[1:], subparsers.choices[argv[0]])
        except ValueError as exc:
            parser.exit(2, f"kvpilot {argv[0]}: error: {exc}\n")
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        sys.exit(2)
    code = args._run(args)
    sys.exit(code or 0)
