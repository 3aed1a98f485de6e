"""Entry point for `python -m minigpt` (what torchrun launches)."""

from minigpt.cli.main import main

main()
