"""vLLM engine flags that kvpilot takes from a copied command line and that change nothing here.

Each is accepted so that a vLLM manifest runs unchanged, and its help says why it has no effect:
kvpilot never compiles the model (no torch.compile, no CUDA graphs), always runs its own model
implementations, runs no repository code, and serves one engine per pod (scale with replicas).
None of them is an ``EngineArgs`` field: ``EngineArgs.from_cli_args`` leaves them out.
"""

from __future__ import annotations

import argparse

from kvpilot.argv import json_object, only_one

OPTIMIZATION_LEVELS = range(4)
"""vLLM's ``-O`` levels (0: no compilation ... 3: the most)."""


def add_accepted_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags to ``parser`` in a group of their own (values are parsed and checked as
    vLLM checks them, so a typo is still an error).

    Raises (at parse time, as argparse errors): a level outside 0-3, a ``--compilation-config``
    that is not a JSON object, ``--data-parallel-size`` other than 1, ``--model-impl
    transformers``.
    """
    group = parser.add_argument_group(
        "accepted from vLLM command lines (change nothing in kvpilot)"
    )
    group.add_argument(
        "-O",
        "--optimization-level",
        type=int,
        choices=OPTIMIZATION_LEVELS,
        default=None,
        help="vLLM's compilation level; kvpilot never compiles the model",
    )
    group.add_argument(
        "--compilation-config",
        "-cc",
        type=json_object,
        default=None,
        metavar="JSON",
        help="vLLM's torch.compile and CUDA graph settings; kvpilot never compiles the model",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's overlap of scheduling with the forward pass; kvpilot's engine core "
        "schedules between steps in its own process either way",
    )
    group.add_argument(
        "--model-impl",
        choices=("auto", "vllm"),
        default="auto",
        help="kvpilot always runs its own implementation of the architecture (transformers' "
        "is not an option)",
    )
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=only_one("one engine per pod"),
        default=1,
        help="1 only: one engine per pod; replicas serve more",
    )
    group.add_argument(
        "--code-revision",
        default=None,
        help="the revision of a repository's model code; kvpilot runs no repository code",
    )
    group.add_argument(
        "--max-parallel-loading-workers",
        type=int,
        default=None,
        help="vLLM's loading in batches of workers; kvpilot's ranks load their shards at once",
    )
