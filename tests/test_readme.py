"""The README's promises about itself and CI: two command lines do everything, and CI runs the second."""

from __future__ import annotations

import re
import subprocess

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
    assert CI.rstrip().splitlines()[-1] == first_code_block()[1]  # runs it, written out
    (extract,) = re.findall(r"^readme_test_command=\$\((.*)\)$", CI, re.M)
    got = subprocess.run(["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == first_code_block()[1]
    assert f'!= "{first_code_block()[1]}" ]' in CI  # and refuses to run when the README's line changed
