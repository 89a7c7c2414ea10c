"""``kvpilot generate``: offline generation from the command line.

Example::

    kvpilot generate --prompt "What is a GPU?" --max-tokens 64

Takes every engine flag (``--model``, ``--max-model-len``, ``--kv-cache-memory``, ...) plus the
sampling flags below; an unset ``--temperature``, ``--top-p``, ``--top-k`` or ``--min-p`` takes
the model's recommended value (its generation config, ``--generation-config``), else the
engine's default, as an API request would. Prompts are wrapped in the model's chat template
unless ``--no-chat-template``. Nothing heavy is imported until ``run``.
"""

from __future__ import annotations

import argparse
import sys

from kvpilot.engine.config import ENGINE_FLAGS, EngineArgs, name_flags

SAMPLING_FLAGS = {
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "n": "--n",
    "seed": "--sampling-seed",
    "max_tokens": "--max-tokens",
    "stop": "--stop",
}
"""The flag of each ``SamplingParams`` field this command sets (what its errors name)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the prompt, sampling and engine flags."""
    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="a prompt; repeat the flag for several (batched together)",
    )
    parser.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap each prompt as a user message in the model's chat template (when it has one)",
    )
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens", type=int, default=128, help="most tokens to generate per prompt"
    )
    model_default = "default: the model's generation config, else %s"
    sampling.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"0 for greedy decoding ({model_default % 1.0})",
    )
    sampling.add_argument("--top-p", type=float, default=None, help=model_default % 1.0)
    sampling.add_argument(
        "--top-k", type=int, default=None, help=f"0 or -1: disabled ({model_default % 0})"
    )
    sampling.add_argument("--min-p", type=float, default=None, help=model_default % 0.0)
    sampling.add_argument("--n", type=int, default=1, help="sequences per prompt")
    sampling.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request seed (reproducible samples)"
    )
    sampling.add_argument("--stop", action="append", default=[], help="a stop string; repeatable")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    """Load the engine (with a progress bar), generate, print each completion.

    Returns:
        0 on success, 2 when an argument is refused or the model cannot be found (one line on
        stderr, naming the flag; every argument that can be checked without loading the
        weights is checked before the progress bar starts).
    """
    import dataclasses
    import logging

    from kvpilot.engine.llm import LLM
    from kvpilot.engine.sampling_params import SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    given = {
        name: getattr(args, name)
        for name in ("temperature", "top_p", "top_k", "min_p")
        if getattr(args, name) is not None
    }
    requested = dict(
        n=args.n,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    try:
        SamplingParams(**given, **requested)  # a bad value is refused before the model loads
    except ValueError as exc:
        print(f"kvpilot generate: error: {name_flags(str(exc), SAMPLING_FLAGS)}", file=sys.stderr)
        return 2
    # Both spellings' underscored names (max_model_len, max_tokens) in the engine's errors.
    flags = {**ENGINE_FLAGS, **{k: v for k, v in SAMPLING_FLAGS.items() if "_" in k}}
    try:
        engine_args = EngineArgs.from_cli_args(args)
        llm = LLM(show_progress=True, **vars(engine_args))
        params = dataclasses.replace(llm.get_default_sampling_params(), **given, **requested)
        if args.chat_template and llm.get_tokenizer().chat_template:
            conversations = [[{"role": "user", "content": p}] for p in args.prompt]
            outputs = llm.chat(conversations, params)
        else:
            outputs = llm.generate(args.prompt, params)
    except (ValueError, FileNotFoundError) as exc:  # bad arguments; a model that cannot be found
        print(f"kvpilot generate: error: {name_flags(str(exc), flags)}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompt, outputs, strict=True):
        print(f"\n### Prompt: {prompt}")
        for completion in output.outputs:
            label = f" [{completion.index}]" if len(output.outputs) > 1 else ""
            print(
                f"### Output{label} ({len(completion.token_ids)} tokens, {completion.finish_reason}):"
            )
            print(completion.text)
    return 0
