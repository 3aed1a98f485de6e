"""Usage errors are one `error:` line with exit code 2 and the closest valid name, never a box or traceback;
the command list of `--help` gives each command one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minigpt.cli.main import app


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["generate", "--temp", "3", "x"],
            "unknown option --temp for `minigpt generate`: did you mean --temperature?",
        ),
        (["params", "--presets", "tiny"], "did you mean --preset?"),
        (["train", "--max-iter", "3", "x"], "did you mean --max-iters?"),
        (["genrate"], "unknown command 'genrate': did you mean 'generate'?"),
        (["nonsense"], "unknown command 'nonsense' (see `minigpt --help`)"),
        (["params", "--n-layer", "abc"], "invalid value for '--n-layer'"),
        (["eval"], "missing argument"),
        (["generate", "--backend", "jax", "x"], "invalid value for '--backend'"),
    ],
)
def test_usage_error_is_one_line_with_a_suggestion(runner, args: list[str], expected: str) -> None:
    result = runner.invoke(app, args, prog_name="minigpt")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]
    assert result.stdout == ""


@pytest.mark.slow
def test_usage_errors_in_a_real_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "minigpt", "generate", "--top_k", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "did you mean --top-k?" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "minigpt"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Usage:" in proc.stdout  # no command: the help, not an error line


@pytest.mark.parametrize("group", [[], ["convert"]])
def test_the_command_list_gives_each_command_one_line(runner, group: list[str]) -> None:
    """typer's rich help keeps the line breaks of a command's first docstring paragraph in the command list
    of `--help`, so that paragraph is one line: at a width that fits them, each command is one row."""
    result = runner.invoke(app, [*group, "--help"], prog_name="minigpt", env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = next(i for i, line in enumerate(lines) if "─ Commands ─" in line)
    rows = lines[start + 1 : next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))]
    assert len(rows) >= 4 and all(row.startswith("│ ") and row[2] != " " for row in rows), "\n".join(rows)
