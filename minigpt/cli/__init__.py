"""The command line: the typer app, its options made from the configs, and what the commands print."""
