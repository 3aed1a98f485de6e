"""Once, by hand (never in CI): lm-evaluation-harness against `minigpt serve` and against the Hugging Face
export of the same run give the same results.

Trains a run with every default (or takes --run), exports it with `convert to-hf`, serves it with `minigpt
serve`, then runs lm-evaluation-harness twice on the tasks in bench/lm_eval/ (a 32-item multiple-choice
task, a loglikelihood task, and a 10-item generate_until task): `--model local-completions` against the
server (tokenizer: the export's, through AutoTokenizer) and `--model hf` on the export. Compares accuracy,
every choice's log-likelihood (to 1e-3) and every generation, and prints a markdown table.

lm-evaluation-harness lives in its own environment (it pins its own dependencies):

    python -m venv /tmp/lmeval-venv && /tmp/lmeval-venv/bin/pip install torch==2.13.0 "lm-eval[api]" accelerate
    python bench/check_lm_eval.py --lm-eval-python /tmp/lmeval-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MINIGPT = [sys.executable, "-m", "minigpt"]
TASKS = "minigpt_mc,minigpt_gen"


def check_run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def serve(run: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with log.open("w") as f:
        proc = subprocess.Popen(
            [*MINIGPT, "serve", str(run), "--port", "0"], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
        )
    for _ in range(600):
        found = re.search(r"serving on (http://\S+?)/ ", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"minigpt serve exited: {log.read_text()}")
        time.sleep(0.1)
    raise SystemExit(f"minigpt serve did not start: {log.read_text()}")


def lm_eval(python: str, model: str, args: str, out: Path) -> dict[str, Any]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    check_run([python, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", TASKS,
               "--include_path", "bench/lm_eval", "--log_samples", "--output_path", str(out), "--device", "cpu",
               "--batch_size", "8", "--seed", "0"], env)  # fmt: skip
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {}
    for task in TASKS.split(","):
        lines = next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
        samples[task] = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
    return {"results": results, "samples": samples}


def longest(run: Path) -> int:
    """The most tokens of a context and a choice in the multiple-choice task: both models score them whole
    only if it fits in the context (else each truncates its own way)."""
    from minigpt.runs.folder import RunDir

    tok = RunDir(run).tokenizer()
    items = [json.loads(line) for line in (ROOT / "bench" / "lm_eval" / "mc.jsonl").read_text().splitlines()]
    return max(len(tok.encode(d["context"] + c)) for d in items for c in d["choices"])


def compare(served: dict[str, Any], hf: dict[str, Any]) -> list[str]:
    rows = []
    acc = [r["results"]["minigpt_mc"]["acc,none"] for r in (served, hf)]
    pairs = [
        (float(a[0][0]), float(b[0][0]))
        for s, h in zip(served["samples"]["minigpt_mc"], hf["samples"]["minigpt_mc"], strict=True)
        for a, b in zip(s["resps"], h["resps"], strict=True)
    ]
    worst = max(abs(a - b) for a, b in pairs)
    rows.append(f"| minigpt_mc (32 items, 4 choices) | accuracy | {acc[0]:.4f} | {acc[1]:.4f} |")
    rows.append(
        f"| minigpt_mc | largest per-choice log-likelihood difference ({len(pairs)} choices) | {worst:.2e} | |"
    )
    gens = [[s["filtered_resps"][0] for s in r["samples"]["minigpt_gen"]] for r in (served, hf)]
    same = sum(a == b for a, b in zip(*gens, strict=True))
    rows.append(
        f"| minigpt_gen (10 prompts, until newline, 16 tokens) | same generations | {same} of {len(gens[0])} | |"
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="the run to check (default: train one with every default)")
    p.add_argument("--text", type=Path, default=ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")
    p.add_argument("--max-time", default="60s")
    p.add_argument("--lm-eval-python", default="/tmp/lmeval-venv/bin/python")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        run = args.run
        if run is None:
            run = tmp / "default"
            check_run(
                [
                    *MINIGPT,
                    "train",
                    str(args.text),
                    "--out",
                    str(run),
                    "--max-time",
                    args.max_time,
                    "--device",
                    "cpu",
                ]
            )
        hf = tmp / "hf"
        check_run([*MINIGPT, "convert", "to-hf", str(run), str(hf)])
        block = json.loads((run / "config.json").read_text())["model"]["block_size"]
        if longest(run) >= block:
            raise SystemExit(
                f"an item is {longest(run)} tokens, more than the context minus one ({block - 1})"
            )
        proc, url = serve(run, tmp / "serve.log")
        try:
            served = lm_eval(
                args.lm_eval_python, "local-completions",
                f"model={run.name},base_url={url}/v1/completions,tokenizer={hf},tokenizer_backend=huggingface,"
                f"max_length={block},num_concurrent=1,max_retries=1",
                tmp / "served",
            )  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        theirs = lm_eval(
            args.lm_eval_python, "hf", f"pretrained={hf},dtype=float32,max_length={block}", tmp / "hf-out"
        )
        version = check_run(
            [args.lm_eval_python, "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"]
        )
    print(f"lm-evaluation-harness {version.strip()}\n")
    print(
        "| task | measure | local-completions on `minigpt serve` | `--model hf` on the export |\n|---|---|---:|---:|"
    )
    print("\n".join(compare(served, theirs)))


if __name__ == "__main__":
    main()
