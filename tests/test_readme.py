"""The README's promises about itself and CI: two command lines do everything, and CI runs the second (then
lints)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def first_code_block() -> list[str]:
    block = re.search(r"^```\w*\n(.*?)^```", README, re.S | re.M)
    assert block is not None
    return block.group(1).strip().splitlines()


def test_the_first_code_block_is_two_commands_install_and_demo_then_install_and_test() -> None:
    install_demo, install_test = first_code_block()
    assert install_demo.startswith("pip install torch==") and install_demo.endswith("&& minigpt demo")
    assert install_test.startswith("pip install torch==") and "'.[dev]'" in install_test
    assert install_test.endswith("&& python -m pytest")


def test_ci_runs_the_readme_test_command_in_a_fresh_environment() -> None:
    """.ci/run makes a new virtual environment every time and runs the README's second command line,
    read from the README by the very line that .ci/run uses."""
    assert re.search(r"^python3 -m venv \"\$venv\"$", CI, re.M) and '. "$venv/bin/activate"' in CI
    assert first_code_block()[1] in CI.splitlines()  # runs it, written out
    (extract,) = re.findall(r"^readme_test_command=\$\((.*)\)$", CI, re.M)
    got = subprocess.run(["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == first_code_block()[1]
    assert f'!= "{first_code_block()[1]}" ]' in CI  # and refuses to run when the README's line changed


def run_ci_tail(tmp_path: Path, failing: str) -> tuple[int, list[str]]:
    """.ci/run from its README test command on, with pip, python and ruff replaced by stubs that log their
    arguments (`failing` exits 1): the exit status and the log."""
    for tool in ("pip", "python", "ruff"):
        stub = tmp_path / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/log"\nexit {int(tool == failing)}\n')
        stub.chmod(0o755)
    lines = CI.splitlines()
    tail = "\n".join(["set -euo pipefail", *lines[lines.index(first_code_block()[1]) :]])
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", tail], cwd=tmp_path, env=env, capture_output=True, text=True)
    return done.returncode, (tmp_path / "log").read_text().splitlines()


def test_ci_lints_and_checks_formatting_once_the_tests_pass(tmp_path: Path) -> None:
    assert "set -euo pipefail" in CI.splitlines()
    assert run_ci_tail(tmp_path, failing="") == (
        0, ["pip install torch==2.13.0 -e .[dev]", "python -m pytest", "ruff check .", "ruff format --check ."]
    )  # fmt: skip


@pytest.mark.parametrize("failing", ["pip", "python", "ruff"])
def test_ci_fails_when_the_install_the_tests_or_the_lint_fail(tmp_path: Path, failing: str) -> None:
    status, log = run_ci_tail(tmp_path, failing)
    assert status != 0 and log[-1].startswith(failing)  # nothing runs after the failed step
