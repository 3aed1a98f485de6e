"""Instruction fine-tuning: a model pretrained on tinyshakespeare learns to follow instructions, in full and
with LoRA, scored by exact match on held-out prompts.

    python bench/bench_finetune.py                         # 2 min pretraining, 3 min per fine-tuning
    python bench/bench_finetune.py --pretrain 30s --finetune 30s --keep /tmp/ft   # a quick look
    python bench/bench_finetune.py --base /tmp/ft/base --finetune 90s --lora none --rank-cut 8,16,32

The task needs the instruction read: each prompt is an instruction and 2-5 words from Shakespeare, and the
answer (computed here) depends on the instruction: the first word, the last word, the words reversed, how
many there are (in letters), or the words in capitals. The held-out prompts are word lists and instructions
the fine-tuning never saw together.

Every step is a whole `minigpt` command, timed from outside, with its peak RSS (wait4): the base is
`minigpt train tinyshakespeare.txt --tokenizer char --block-size 128 --n-layer 4 --max-time PRETRAIN`
(`--tokenizer`; `--base-flags`: the CPU recipe's `nano` shape with 4 blocks in place of 2, README
"Fine-tuning and chat"), each fine-tuning `minigpt train --init-from BASE train.jsonl --max-time FINETUNE`
(plus `--lora-rank R` and the --lora flags), and each model answers every held-out prompt through
`minigpt chat RUN -t 0 --json` (piped, greedy). "base" is the pretrained model answering through the same
chat template before any fine-tuning (its new chat tokens at their initial rows). Trainable parameters and optimizer memory are read from the run's files.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five"}
TASKS = {
    "first": lambda ws: ws[0],
    "last": lambda ws: ws[-1],
    "reverse": lambda ws: " ".join(reversed(ws)),
    "count": lambda ws: NUMBERS[len(ws)],
    "upper": lambda ws: " ".join(ws).upper(),
}


def vocabulary(text: str, size: int = 400) -> list[str]:
    """The most frequent lower-case words of 3 to 6 letters in the text."""
    counts = collections.Counter(re.findall(r"\b[a-z]{3,6}\b", text))
    return sorted(w for w, _ in counts.most_common(size))


def make_data(words: list[str], n_train: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Training conversations and held-out prompts: (instruction, words) pairs never in the training set."""
    rng = random.Random(seed)

    def draw() -> tuple[str, tuple[str, ...]]:
        return rng.choice(list(TASKS)), tuple(rng.sample(words, rng.randint(2, 5)))

    test: dict[tuple[str, tuple[str, ...]], None] = {}
    while len(test) < n_test:
        test[draw()] = None
    train = []
    while len(train) < n_train:
        task, ws = draw()
        if (task, ws) not in test:
            train.append({"prompt": f"{task}: {' '.join(ws)}", "completion": TASKS[task](list(ws))})
    held_out = [{"task": t, "prompt": f"{t}: {' '.join(ws)}", "answer": TASKS[t](list(ws))} for t, ws in test]
    return train, held_out


def command(args: list[str], cwd: Path, stdin: bytes = b"") -> dict:
    """Run `python -m minigpt ARGS`: wall seconds, peak RSS (MB, from wait4) and output; a failure stops
    the benchmark."""
    env = {**os.environ, "MINIGPT_CACHE_DIR": str(cwd / "cache")}
    cmd = [sys.executable, "-m", "minigpt", *args]
    with tempfile.TemporaryFile() as i, tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        i.write(stdin)
        i.seek(0)
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=i, stdout=o, stderr=e)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        o.seek(0)
        e.seek(0)
        out, err = o.read().decode(), e.read().decode()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return {"wall": wall, "rss_mb": usage.ru_maxrss / 1024, "stdout": out, "stderr": err}


def answers(run: Path, prompts: list[dict], cwd: Path) -> list[str]:
    """Every held-out prompt answered greedily by `minigpt chat` with piped input."""
    stdin = "".join(json.dumps({"prompt": p["prompt"]}) + "\n" for p in prompts).encode()
    result = command(["chat", str(run), "-t", "0", "-n", "48", "--json"], cwd, stdin)
    return [json.loads(line)["answer"] for line in result["stdout"].splitlines()]


def base_answers(base: Path, prompts: list[dict]) -> list[str]:
    """The base model through the chat template: its weights with the chat tokens added, before training."""
    sys.path.insert(0, str(ROOT))
    import torch

    from minigpt.chat.session import ChatSession
    from minigpt.generate.config import GenerateConfig
    from minigpt.generate.engines.torch_engine import TorchEngine
    from minigpt.train.config import TrainConfig
    from minigpt.train.finetune import full_model, plan_fine_tune

    tokenizer, shape, _ = plan_fine_tune(base, TrainConfig(), chat=True)
    engine = TorchEngine(full_model(shape, base, torch.device("cpu")).eval())
    session = ChatSession(engine, tokenizer, GenerateConfig(max_new_tokens=48, temperature=0.0))
    out = []
    for p in prompts:
        session.reset()
        reply = session.ask(p["prompt"])
        out.append("".join(reply.pieces()))
    return out


def score(prompts: list[dict], got: list[str]) -> tuple[float, dict[str, float]]:
    hits = collections.defaultdict(list)
    for p, a in zip(prompts, got, strict=True):
        hits[p["task"]].append(a.strip() == p["answer"])
    total = [h for task in hits.values() for h in task]
    return 100 * sum(total) / len(total), {t: 100 * sum(h) / len(h) for t, h in hits.items()}


def run_facts(run: Path) -> dict:
    """Steps, trainable parameters and the optimizer's state in bytes, from the run's own files."""
    import math

    from safetensors import safe_open

    config = json.loads((run / "config.json").read_text())
    with safe_open(str(run / "state.safetensors"), framework="np") as f:
        sizes = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    trainable = sum(n for k, n in sizes.items() if k.startswith("model/"))
    moments = sum(n for k, n in sizes.items() if k.startswith("optim/") and not k.endswith("/step"))
    return {
        "steps": config["metrics"]["last"]["step"],
        "trainable": trainable,
        "optimizer_bytes": 4 * moments,
    }


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def rank_cut(tuned: Path, base: Path, rank: int, out: Path) -> float:
    """A copy of the fine-tuned run `tuned` whose change to each block matrix (its weights minus the base's)
    is cut to its best rank-`rank` approximation (SVD), every other tensor as it trained: is a low-rank
    solution in what full fine-tuning found? Returns the share of the changes' energy (squared singular
    values) kept, averaged over the matrices."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    weights = "model.safetensors"
    with safe_open(str(tuned / weights), framework="np") as f, safe_open(str(base / weights), "np") as b:
        meta, kept, cut = f.metadata(), [], {}
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            w = f.get_tensor(name)
            if name.startswith("transformer.h.") and w.ndim == 2:
                u, s, vt = np.linalg.svd((w - b.get_tensor(name)).astype(np.float64), full_matrices=False)
                kept.append(float((s[:rank] ** 2).sum() / max((s**2).sum(), 1e-300)))
                w = (b.get_tensor(name) + (u[:, :rank] * s[:rank]) @ vt[:rank]).astype(np.float32)
            cut[name] = w
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(tuned, out)
    save_file(cut, str(out / weights), metadata=meta)
    return sum(kept) / len(kept)


# the base: the CPU recipe's nano shape (128 wide, 4 heads) with 4 blocks, not its 2. Full fine-tuning is at
# 98-99% on either, but on 2 blocks LoRA learned to count and pick words, not to copy them out reversed or in
# capitals (44-68% exact match), and on 4 it does (README, "Fine-tuning and chat")
BASE_FLAGS = "--n-layer 4"

# the LoRA rows of a default run: rank 8 on every block matrix, and rank 4 with the embedding and the head
# trained whole (8.5% and 6.2% of the parameters of the benchmark's 4-block base)
LORA_DEFAULT = ("8", "4:--lora-targets all,embedding,head")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pretrain", default="2m", help="the base model's training budget")
    parser.add_argument("--finetune", default="3m", help="each fine-tuning's budget")
    parser.add_argument("--pretrain-steps", type=int, help="train the base for this many steps instead")
    parser.add_argument("--finetune-steps", type=int, help="fine-tune for this many steps instead")
    parser.add_argument("--base", type=Path, help="reuse this base run instead of pretraining one")
    parser.add_argument(
        "--lora", action="append", metavar="RANK[:FLAGS]",
        help="a LoRA fine-tuning: its rank and extra flags, e.g. '4:--lora-targets all,embedding,head' "
        f"(repeatable; 'none' for none; default: {' and '.join(repr(v) for v in LORA_DEFAULT)})",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer",
        default="char",
        help="the base's tokenizer (default char; bpe: minigpt's default, 512 tokens)",
    )
    parser.add_argument(
        "--base-flags",
        default=BASE_FLAGS,
        help=f"the base's shape, as flags of `minigpt train` (default {BASE_FLAGS!r}; '' for the CPU default)",
    )
    parser.add_argument("--train", type=int, default=20000, help="training conversations")
    parser.add_argument("--test", type=int, default=500, help="held-out prompts")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temp folder)")
    parser.add_argument("--full-flags", default="", help="extra flags for the full fine-tuning")
    parser.add_argument(
        "--rank-cut", default="", metavar="R,R,...",
        help="also score the full fine-tuning with its change to each block matrix cut to these ranks",
    )  # fmt: skip
    args = parser.parse_args()
    if not SHAKESPEARE.is_file():
        raise SystemExit(f"needs {SHAKESPEARE}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{cpu_model()}, {os.cpu_count()} cores; load at the start {load()}; working in {work}", flush=True)

    base = args.base or work / "base"
    if args.base is None:
        budget = (
            ["--max-iters", str(args.pretrain_steps)]
            if args.pretrain_steps
            else ["--max-time", args.pretrain]
        )
        pre = command(["train", str(SHAKESPEARE), "--tokenizer", args.tokenizer, "--block-size", "128", *budget,
                       *shlex.split(args.base_flags), "--out", str(base), "--overwrite"], work)  # fmt: skip
        print(f"pretrained {base} in {pre['wall']:.1f} s (load {load()})", flush=True)
    ft_budget = (
        ["--max-iters", str(args.finetune_steps)] if args.finetune_steps else ["--max-time", args.finetune]
    )

    train, test = make_data(vocabulary(SHAKESPEARE.read_text()), args.train, args.test, seed=1)
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in train))

    rows = [("base (no fine-tuning)", None, base_answers(base, test), None, None)]
    variants = [("full fine-tuning", args.full_flags.split())]
    for spec in [] if args.lora == ["none"] else args.lora or LORA_DEFAULT:
        rank, _, flags = spec.partition(":")
        variants.append((f"LoRA rank {rank} {flags}".strip(), ["--lora-rank", rank, *flags.split()]))
    for i, (name, flags) in enumerate(variants):
        out = work / f"finetune-{i}"
        result = command(["train", "--init-from", str(base), str(data), *ft_budget, "--out", str(out),
                          "--overwrite", *flags], work)  # fmt: skip
        print(
            f"{name}: {result['wall']:.1f} s, peak RSS {result['rss_mb']:.0f} MB (load {load()})", flush=True
        )
        rows.append((name, out, answers(out, test, work), result, run_facts(out)))
        for rank in [int(r) for r in args.rank_cut.split(",") if r] if i == 0 else []:
            kept = rank_cut(out, base, rank, work / f"rank-cut-{rank}")
            got = answers(work / f"rank-cut-{rank}", test, work)
            print(f"full fine-tuning cut to rank {rank}: {score(test, got)[0]:.1f}% exact match, "
                  f"{kept:.1%} of the change's energy kept", flush=True)  # fmt: skip

    print(f"\nload at the end {load()}\n")
    print("| model | exact match | " + " | ".join(TASKS) + " | trainable parameters | optimizer state | "
          "peak RSS | steps | wall |")  # fmt: skip
    print("|---|---:|" + "---:|" * len(TASKS) + "---:|---:|---:|---:|---:|")
    for name, _, got, result, facts in rows:
        overall, by_task = score(test, got)
        tasks = " | ".join(f"{by_task[t]:.0f}%" for t in TASKS)
        if facts is None:
            print(f"| {name} | {overall:.1f}% | {tasks} | - | - | - | - | - |")
            continue
        share = facts["trainable"] / rows[1][4]["trainable"]  # of the fine-tuned model's parameters
        print(
            f"| {name} | {overall:.1f}% | {tasks} | {facts['trainable']:,} ({share:.1%}) | "
            f"{facts['optimizer_bytes'] / 2**20:.2f} MB | {result['rss_mb']:.0f} MB | {facts['steps']:,} | "
            f"{result['wall']:.0f} s |"
        )
    tuned = rows[1:]
    print("\n| prompt | answer | " + " | ".join(name for name, *_ in tuned) + " |")
    print("|---|---|" + "---|" * len(tuned))
    for i, p in enumerate(test[:5]):
        print(f"| {p['prompt']} | {p['answer']} | " + " | ".join(got[i] for _, _, got, *_ in tuned) + " |")


if __name__ == "__main__":
    main()
