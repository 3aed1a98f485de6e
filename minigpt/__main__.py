"""Entry point for `python -m minigpt` (what torchrun launches)."""

from minigpt.cli import main

main()
