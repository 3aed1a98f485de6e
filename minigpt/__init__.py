"""minigpt: train, sample and inspect small GPT-style language models."""

__version__ = "0.2.0"
