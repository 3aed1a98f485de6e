# Convenience targets; the README's two commands work without make.
PY ?= python
TORCH ?= torch==2.13.0

.PHONY: install test test-fast demo lint bench
install:
	$(PY) -m pip install $(TORCH) -e '.[dev]'
test:
	$(PY) -m pytest
test-fast:  # the fast tier: every module's core behaviour, without the tests marked slow
	$(PY) -m pytest -m "not slow"
demo:
	$(PY) -m minigpt demo
lint:
	ruff check . && ruff format --check .
bench:  # each prints a markdown table for the README; about an hour together on 2 cores (the recipe's 35 min)
	$(PY) bench/bench_train.py --skip-recipe
	$(PY) bench/bench_overhead.py
	$(PY) bench/bench_recipe.py --budget 75s --seeds 2 --bpe
	$(PY) bench/bench_generate.py
	$(PY) bench/bench_tokenize.py --mb 10
	$(PY) bench/bench_budget.py
