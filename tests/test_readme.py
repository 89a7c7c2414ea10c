"""The README documents every ``kvpilot`` subcommand."""

from __future__ import annotations

import pathlib
import re

from kvpilot.cli import COMMANDS

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_every_subcommand_is_in_the_readme():
    text = README.read_text()
    named = {name for name in COMMANDS if re.search(rf"\bkvpilot {re.escape(name)}\b", text)}
    assert named == set(COMMANDS)
    assert "kvpilot ray-node leader --nodes 2 -- serve" in text  # its usage, not a mention
