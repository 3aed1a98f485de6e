"""Run minigpt from a checkout without installing it: `python cli.py --help`."""

from minigpt.cli.main import main

if __name__ == "__main__":
    main()
