#!/usr/bin/env bash
# What a lent GPU machine runs for the GPU path, in one go (README: "GPU"): the GPU tests, then
# bench/bench_gpu.py. Usage: bench/gpu_check.sh TEXT RANKS.tiktoken OUT [bench_gpu.py options...]
# It runs in the machine's own Python (torch there), with minigpt on PYTHONPATH and the packages that Python
# lacks installed first: rustbpe and backports.zstd, and typer >= 0.29 with its dependencies (pydantic,
# pydantic-core, annotated-doc, typing-inspection), which typer imports when a command runs: without them
# every CliRunner invocation there ended in an exception and exit code 1 with no output.
set -uo pipefail
text=$1 ranks=$2 out=$3
shift 3
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv | tee "$out/nvidia-smi.txt"
timeout 200 python3 -m pytest tests/test_gpu.py -p no:cacheprovider -v --durations=12 2>&1 | tee "$out/tests.log" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|^E " | tail -40
timeout 270 python3 bench/bench_gpu.py --text "$text" --tokenizer "$ranks" --out "$out" "$@" 2>&1 | grep -v '^USDT' | tee "$out/bench.log"
