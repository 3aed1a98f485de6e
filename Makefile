# Convenience targets; the README's two commands work without make.
PY ?= python
TORCH ?= torch==2.13.0

.PHONY: install test demo lint bench
install:
	$(PY) -m pip install $(TORCH) -e '.[dev]'
test:
	$(PY) -m pytest
demo:
	$(PY) -m minigpt demo
lint:
	ruff check . && ruff format --check .
bench:
	$(PY) bench/run_all.py
