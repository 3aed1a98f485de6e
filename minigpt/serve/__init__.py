"""`minigpt serve`: an OpenAI-compatible completions API and a web page to explore a model (extra: serve)."""
