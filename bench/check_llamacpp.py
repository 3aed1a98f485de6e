"""Once, by hand (never in CI): does llama.cpp run `minigpt convert to-gguf`'s files as minigpt runs them?

Trains a run with every default (`minigpt train FILE --max-time T`: bpe 512, the modern architecture, so
llama.cpp's llama with biases) and one with GPT-2's architecture and tokenizer (`--arch gpt2 --tokenizer
r50k_base`: llama.cpp's gpt2), exports each with `convert to-gguf`, then compares, for each:

- greedy text: `minigpt generate -t 0` against `llama-completion --temp 0` for a few prompts (within the
  context window: past it llama.cpp keeps every position where minigpt's rotary cache keeps block_size);
- token ids: minigpt's encoder against `llama-tokenize` on mixed-script text (Chinese, English, emoji,
  code, runs of whitespace).

Prints a markdown table for the README. llama.cpp's binaries: ../shared/tools/llama.cpp/bin (or --llama).

    python bench/check_llamacpp.py --text ../shared/data/tinyshakespeare.txt --max-time 60s
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MIXED  # noqa: E402

from minigpt.runs.folder import RunDir  # noqa: E402

PROMPTS = ["ROMEO:", "First Citizen:\nWe are", "KING RICHARD III:\nNow is the", "你好 and the", "\n"]
MINIGPT = [sys.executable, "-m", "minigpt"]


def run(cmd: list[str], **kw: object) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, **kw)  # type: ignore[call-overload]
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def llama_text(llama: Path, gguf: Path, prompt: str, n: int) -> str:
    """llama-completion's greedy continuation (it prints the prompt first)."""
    out = run([str(llama / "llama-completion"), "-m", str(gguf), "-p", prompt, "-n", str(n), "--temp", "0",
               "-no-cnv", "-c", "64", "--no-warmup", "-t", "1"])  # fmt: skip
    assert out.startswith(prompt), out[:200]
    return out[len(prompt) :].removesuffix("\n\n")


def llama_ids(llama: Path, gguf: Path, text_file: Path) -> list[int]:
    out = run([str(llama / "llama-tokenize"), "-m", str(gguf), "-f", str(text_file), "--ids", "--no-bos", "--no-parse-special", "--no-escape",
               "--log-disable"])  # fmt: skip
    return [int(x) for x in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def check(name: str, run_dir: Path, llama: Path, tmp: Path, n: int) -> list[str]:
    gguf = tmp / f"{name}.gguf"
    run([*MINIGPT, "convert", "to-gguf", str(run_dir), str(gguf), "--overwrite"])
    tok = RunDir(run_dir).tokenizer()
    rows = []
    for prompt in PROMPTS:
        ours = run([*MINIGPT, "generate", "--model", str(run_dir), "-n", str(n), "-t", "0", prompt])
        theirs = llama_text(llama, gguf, prompt, n)
        same = ours == theirs
        shown = ours[:40].replace("\n", "⏎")
        rows.append(
            f"| {name} | {prompt!r} | {len(tok.encode(ours))} | {'same' if same else 'DIFFERENT'} | `{shown}` |"
        )
    text_file = tmp / "mixed.txt"
    text = MIXED.rstrip() + "\n" + Path(ROOT / "tests" / "conftest.py").read_text()[:2000]
    text_file.write_text(text, encoding="utf-8")
    ours_ids, theirs_ids = tok.encode(text), llama_ids(llama, gguf, text_file)
    agree = sum(a == b for a, b in zip(ours_ids, theirs_ids, strict=False))
    verdict = "same" if ours_ids == theirs_ids else f"DIFFERENT ({agree} of {len(ours_ids)})"
    rows.append(f"| {name} | token ids of mixed-script text + code | {len(ours_ids)} | {verdict} | |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", type=Path, default=ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")
    p.add_argument("--max-time", default="60s")
    p.add_argument("--run", type=Path, help="a run made with every default to check (default: train one)")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt (prompt + these <= 64)")
    p.add_argument("--llama", type=Path, default=ROOT.parent / "shared" / "tools" / "llama.cpp" / "bin")
    args = p.parse_args()
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT.parent / "shared" / "data"))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        runs = {
            "default settings (llama)": ["--max-time", args.max_time],
            "gpt2 + r50k_base (gpt2)": [
                "--max-time",
                args.max_time,
                "--arch",
                "gpt2",
                "--tokenizer",
                "r50k_base",
            ],
        }
        rows = []
        for i, (name, options) in enumerate(runs.items()):
            out = tmp / f"run{i}"
            if i == 0 and args.run is not None:
                out = args.run
            else:
                run([*MINIGPT, "train", str(args.text), "--out", str(out), "--device", "cpu", *options])
            rows += check(name, out, args.llama, tmp, args.tokens)
    print("| run | prompt | tokens | minigpt vs llama.cpp | text |\n|---|---|---:|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
