"""Serving throughput: aggregate tokens/s of N concurrent streaming clients against `minigpt serve`."""

# Prints a markdown table. The model is bench_generate.py's (6 layers, 6 heads, 384 wide, block 256, 65
# characters, random weights), served by `python -m minigpt serve` on loopback (the NumPy engine, as by
# default on the CPU). Each client sends --requests streamed completions of --tokens tokens one after
# another (the same empty prompt, seeds differing; `--prompts varied`: each request its own prompt, 1 to 40
# characters, so that requests stand at different positions, as a server's clients do); all start
# together. `--against DIR` adds a default server run from another checkout (`git worktree add
# /tmp/before HEAD~3`), to compare code with code under the same load. The same loads against a server
# with --max-batch 1 (one row decoding at a time, the others queued) show what batching gains, and with
# --kv-cache float32 what the default float16 KV cache gains. At each client count the servers run one
# after another, so that the machine's swings fall on all of them alike.
#
#     python bench/bench_serve.py                       # about a minute on 2 cores
#     python bench/bench_serve.py --clients 1 8 --requests 2
#     python bench/bench_serve.py --clients 8 16 --prompts varied --against /tmp/before

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from bench_generate import CONFIG, ROOT, tokenizer  # also puts this checkout first on sys.path

from minigpt.model.gpt import GPT
from minigpt.runs.folder import RunDir

PROMPT_TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east. "


def prompt(varied: bool, client: int, request: int) -> str:
    """A request's prompt: empty, or (varied) 1 to 40 characters, a different length for each request."""
    return PROMPT_TEXT[: 1 + (client * 7 + request * 13) % 40] if varied else ""


def start_server(
    run_dir: Path, log: Path, *args: str, code: Path = ROOT
) -> tuple[subprocess.Popen[bytes], str]:
    """`minigpt serve RUN --port 0 ARGS` in its own process, as a user starts it, from the checkout
    `code`; (process, host:port)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(code)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "minigpt", "serve", str(run_dir), "--port", "0", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=code,  # -m puts the cwd before PYTHONPATH
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"serving on http://(\S+?)/ ", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


def stream(address: str, tokens: int, seed: int, text: str = "") -> tuple[int, float]:
    """One streamed completion read as a client reads it: (tokens generated, seconds to the first chunk)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"prompt": text, "max_tokens": tokens, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    first, used = 0.0, 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        first = first or time.perf_counter() - t0
        usage = json.loads(line[6:]).get("usage")
        used = usage["completion_tokens"] if usage else used
    conn.close()
    return used, first


def rows_per_forward(address: str) -> float:
    """The server's mean rows per forward pass since it started (its /health)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())["models"][0]["rows_per_forward"]


def load(address: str, clients: int, requests: int, tokens: int, varied: bool = False) -> tuple[float, float]:
    """(aggregate tokens/s, median time to first token) of `clients` threads sending `requests` each."""
    results: list[tuple[int, float]] = []
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        start.wait()
        for r in range(requests):
            results.append(stream(address, tokens, seed=c * 1000 + r, text=prompt(varied, c, r)))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    assert all(used == tokens for used, _ in results)
    return sum(used for used, _ in results) / seconds, statistics.median(ttft for _, ttft in results)


def measure(
    run_dir: Path, clients: int, args: argparse.Namespace, *options: str, code: Path = ROOT
) -> tuple[float, float, float]:
    """(tokens/s, time to first token, rows per forward) of a fresh server under one load."""
    proc, address = start_server(run_dir, run_dir.parent / "serve.log", *options, code=code)
    try:
        load(address, 1, 1, 16)  # warm up: first-call allocations
        tps, ttft = load(address, clients, args.requests, args.tokens, args.prompts == "varied")
        return tps, ttft, rows_per_forward(address)
    finally:
        proc.terminate()
        proc.wait()


SERVERS = [  # (label, serve's options, checkout: None for this one)
    ("batched (default)", (), None),
    ("batched, `--kv-cache float32`", ("--kv-cache", "float32"), None),
    ("one row at a time (`--max-batch 1`)", ("--max-batch", "1"), None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16], help="concurrent clients")
    ap.add_argument("--requests", type=int, default=3, help="streamed requests per client (default 3)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument(
        "--prompts", choices=("same", "varied"), default="same",
        help="every request's prompt empty (default), or 1-40 characters, differing between requests",
    )  # fmt: skip
    ap.add_argument("--against", type=Path, help="another checkout: its default server joins each load")
    args = ap.parse_args()

    servers = SERVERS + ([(f"batched, the code at {args.against}", (), args.against)] if args.against else [])
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "bench"
        RunDir(run_dir).save(GPT(CONFIG), tokenizer(), extra={})
        for n in args.clients:  # the servers side by side at each load: the machine's swings hit them alike
            for label, options, code in servers:
                rows.append((label, n, *measure(run_dir, n, args, *options, code=code or ROOT)))
                print(f"{label}, {n} clients: {rows[-1][2]:.1f} tokens/s", file=sys.stderr)
    rows.sort(key=lambda row: [label for label, _, _ in servers].index(row[0]))
    prompts = "empty prompts" if args.prompts == "same" else "prompts of 1-40 characters"
    print(
        f"\n{CONFIG.n_layer} layers, {CONFIG.n_head} heads, {CONFIG.n_embd} wide, block {CONFIG.block_size}, "
        f"vocab {CONFIG.vocab_size}; {args.requests} streamed requests of {args.tokens} tokens per client, "
        f"{prompts}; NumPy engine, one BLAS thread; load average {os.getloadavg()[0]:.1f} after\n"
    )
    print("| server | clients | aggregate tokens/s | median time to first token | rows per forward pass |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, n, tps, ttft, rows_per in rows:
        print(f"| {label} | {n} | {tps:,.1f} | {ttft * 1000:,.0f} ms | {rows_per:.1f} |")


if __name__ == "__main__":
    main()
