"""`helm lint` accepts the chart with every values file and rejects bad values by name."""

from __future__ import annotations

import pathlib


def test_lint_accepts_values(lint, values_file: pathlib.Path | None) -> None:
    done = lint(*([values_file] if values_file else []))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def test_lint_rejects_invalid_values(lint, invalid_values_file: pathlib.Path) -> None:
    """Each file's first line says which field the error must name (``# expect: FIELD``)."""
    first_line = invalid_values_file.read_text().splitlines()[0]
    assert first_line.startswith("# expect: "), f"{invalid_values_file.name} lacks its expect line"
    field = first_line.removeprefix("# expect: ")
    done = lint(invalid_values_file)
    assert done.returncode != 0
    assert "0 chart(s) failed" not in done.stdout
    assert field in done.stdout + done.stderr
