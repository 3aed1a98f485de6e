"""Run minigpt from a checkout without installing it: `python cli.py --help`."""

from minigpt.cli import main

if __name__ == "__main__":
    main()
