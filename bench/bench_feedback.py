"""Learning from feedback on a task with a checkable answer: two- and three-digit addition, answered by a
small char model, the sum written from its last digit (`83+931` is answered `4101`): the order in which the
digits can be worked out, carries included, which a small transformer learns in minutes where the usual
order takes it far longer (Lee et al., "Teaching Arithmetic to Small Transformers", 2023); `--answers
forward` writes sums as usual. A base pretrained on sums and fine-tuned briefly on them as conversations
(the SFT model) is then trained with RL (GRPO, the exact-match reward) in full and with LoRA, and with DPO
on generated preference pairs (the right sum against a wrong one); each is scored by the exact match of its
greedy answers to held-out problems, through `minigpt eval RUN test.jsonl`.

    python bench/bench_feedback.py                                   # the measurement: one command
    python bench/bench_feedback.py --quick --keep /tmp/fb            # short budgets, to try a recipe
    python bench/bench_feedback.py --smoke                           # seconds a run: every table prints
    python bench/bench_feedback.py --sft /tmp/fb/sft --only rl --rl 3m --rl-flags "--lr 1e-3"

Every step is a whole `minigpt` command, timed from outside, with the load average before and after:
`minigpt train sums.txt --tokenizer char --block-size 64 --n-layer 4 --max-iters PRETRAIN` (the base),
`minigpt train --init-from BASE sft.jsonl --max-iters SFT` (the SFT model), then from it
`minigpt train --init-from SFT tasks.jsonl --val-file val.jsonl --max-time RL` (+ `--lora-rank 8`) and
`minigpt train --init-from SFT prefs.jsonl --val-file heldout-prefs.jsonl --max-time DPO`. The start
model is trained for a number of steps, so it is the same whatever the machine and its load; what learns
from feedback gets wall time, as a user gives it. The held-out
problems (500) and the validation ones (200) are in no training set. The DPO run's validation pairs are the
held-out problems' pairs, so its log's preference accuracy is the held-out one; the bench also gives the
share of those pairs whose right sum the model finds likelier than the wrong one (log π(chosen) > log
π(rejected), no reference needed), before and after. It prints markdown tables: the models, and the RL
runs' reward curves (the mean reward of each logged step's sampled answers, and the validation exact match).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
from pathlib import Path

from bench_finetune import ROOT, command, cpu_model, load

DIGITS = (2, 3)
TEST, VAL = 500, 200
# a sum has at most 4 digits, and <|end|>; evaluations every 50 steps draw the reward curve, over all 200
# validation problems (13 batches of 16)
# the rates are train's defaults for tasks and preference pairs (AdamW at 3e-4 and 1e-4, LoRA at 1e-3),
# chosen from this bench: at the CPU recipe's (Muon at 0.012, AdamW at 0.016), RL lost its few right
# answers (sampled reward 0.07 -> 0, KL 2.3 in 110 steps) and DPO's held-out preference accuracy fell from
# 76% to 18-42%
RL_FLAGS = "--answer-tokens 8 --eval-every 50 --eval-iters 13 --log-every 10"
DPO_FLAGS = "--eval-every 50 --eval-iters 20"


def problem(rng: random.Random) -> tuple[int, int]:
    """Two numbers of two or three digits each."""
    a, b = (rng.randrange(10 ** (d - 1), 10**d) for d in (rng.choice(DIGITS), rng.choice(DIGITS)))
    return a, b


def wrong_sum(a: int, b: int, rng: random.Random) -> int:
    """A near miss: the right sum with one digit changed (never the right sum, never a leading zero)."""
    digits = list(str(a + b))
    while True:
        i = rng.randrange(len(digits))
        d = str(rng.randrange(1 if i == 0 else 0, 10))
        if d != digits[i]:
            return int("".join(digits[:i] + [d] + digits[i + 1 :]))


def written(n: int, reverse: bool) -> str:
    """A sum as the model writes it: its digits from the last (the one it can work out first) or as usual."""
    return str(n)[::-1] if reverse else str(n)


def make_data(work: Path, seed: int, sizes: dict[str, int], reverse: bool) -> dict[str, Path]:
    """The benchmark's files: pretraining text, SFT conversations, RL tasks and DPO pairs from training
    problems; validation and held-out tasks (and the held-out pairs) from problems in none of them."""
    rng = random.Random(seed)
    held: dict[tuple[int, int], None] = {}
    while len(held) < sizes["test"] + sizes["val"]:
        held[problem(rng)] = None
    test, val = list(held)[: sizes["test"]], list(held)[sizes["test"] :]

    def fresh(n: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while len(out) < n:
            p = problem(rng)
            if p not in held:
                out.append(p)
        return out

    def task(a: int, b: int) -> dict:
        return {"prompt": f"{a}+{b}", "answer": written(a + b, reverse)}

    def pair(a: int, b: int) -> dict:
        right, wrong = written(a + b, reverse), written(wrong_sum(a, b, rng), reverse)
        return {"prompt": f"{a}+{b}", "chosen": right, "rejected": wrong}

    files = {
        "sums.txt": "".join(f"{a}+{b}={written(a + b, reverse)}\n" for a, b in fresh(sizes["text"])),
        "sft.jsonl": [
            {"prompt": f"{a}+{b}", "completion": written(a + b, reverse)} for a, b in fresh(sizes["sft"])
        ],
        "tasks.jsonl": [task(a, b) for a, b in fresh(sizes["tasks"])],
        "prefs.jsonl": [pair(a, b) for a, b in fresh(sizes["pairs"])],
        "val.jsonl": [task(a, b) for a, b in val],
        "test.jsonl": [task(a, b) for a, b in test],
        "heldout-prefs.jsonl": [pair(a, b) for a, b in test],
    }
    paths = {}
    for name, content in files.items():
        paths[name] = work / name
        text = content if isinstance(content, str) else "".join(json.dumps(r) + "\n" for r in content)
        paths[name].write_text(text)
    return paths


def exact_match(run: Path, test: Path, work: Path, samples: int) -> dict:
    """`minigpt eval RUN test.jsonl`: the share of greedy answers that are exactly right, and pass@k."""
    args = ["eval", str(run), str(test), "--answer-tokens", "8", "--json", "--device", "cpu"]
    result = command([*args, *(["--samples", str(samples)] if samples > 1 else [])], work)
    return json.loads(result["stdout"])


def likelier(run: Path, pairs: Path) -> float:
    """The share of pairs whose chosen answer the run finds likelier than the rejected one."""
    sys.path.insert(0, str(ROOT))
    import torch

    from minigpt.data.dataset import DataConfig
    from minigpt.feedback.dpo import prepare_preferences
    from minigpt.feedback.logprobs import answer_logprobs
    from minigpt.runs.folder import RunDir

    model, tokenizer, _ = RunDir(run).load_model()
    data = prepare_preferences(
        DataConfig(paths=(pairs,), val_fraction=0.5), [pairs], model.config.block_size, tokenizer
    )
    right = total = 0
    with torch.no_grad():
        for split in (data.train, data.val):
            for start in range(0, split.pairs, 64):
                x, y, _ = split.pair_batch(range(start, min(start + 64, split.pairs)))
                logp = answer_logprobs(model, x, y).view(-1, 2)
                right += int((logp[:, 0] > logp[:, 1]).sum())
                total += logp.size(0)
    return right / total


def budget_flags(given: str) -> list[str]:
    """A step count (the start model is then the same on any machine and load) or a --max-time."""
    return ["--max-iters", given] if given.isdigit() else ["--max-time", given]


def train(args: list[str], work: Path, what: str) -> dict:
    before = load()
    result = command(["train", *args, "--overwrite"], work)
    print(
        f"{what}: {result['wall']:.0f} s, peak RSS {result['rss_mb']:.0f} MB (load {before} -> {load()})",
        flush=True,
    )
    return {**result, "load": f"{before} -> {load()}"}


def metrics(run: Path) -> list[dict]:
    """The run's logged records (none if it stopped before its first step's)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def reward_curve(run: Path) -> list[str]:
    """Markdown rows: at each evaluation, the mean reward of the steps logged since the last one, and the
    validation exact match."""
    rows, since = [], []
    for r in metrics(run):
        if r["kind"] == "train" and "reward" in r:
            since.append(r["reward"])
        elif r["kind"] == "eval" and "val_reward" in r:
            mean = sum(since) / len(since) if since else float("nan")
            rows.append(
                f"| {r['step']:,} | {r['elapsed'] / 60:.1f} | {mean:.3f} | {100 * r['val_reward']:.1f}% |"
            )
            since = []
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short budgets, to try a recipe")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds a run and little data: the tables print"
    )
    parser.add_argument(
        "--answers", choices=("reversed", "forward"), default="reversed",
        help="sums written from their last digit (learned in minutes) or as usual (far slower to learn)",
    )  # fmt: skip
    parser.add_argument("--pretrain", default="1250", help="the base's budget: steps, or a time (10m)")
    parser.add_argument(
        "--sft-budget",
        default="700",
        help="the SFT model's budget: steps, or a time (short: room to improve)",
    )
    parser.add_argument("--rl", default="10m", help="each RL run's budget")
    parser.add_argument("--dpo", default="5m", help="the DPO run's budget")
    parser.add_argument("--sft", type=Path, help="reuse this SFT run (and skip the base and SFT)")
    parser.add_argument("--only", choices=("rl", "lora", "dpo"), action="append", help="run only these")
    parser.add_argument("--rl-flags", default="", help="extra flags for both RL runs")
    parser.add_argument("--lora-flags", default="--lora-rank 8", help="the LoRA RL run's flags")
    parser.add_argument("--dpo-flags", default="", help="extra flags for the DPO run")
    parser.add_argument("--seed", type=int, default=1, help="the data's seed")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temp folder)")
    args = parser.parse_args()
    sizes = {"text": 60_000, "sft": 20_000, "tasks": 20_000, "pairs": 5_000, "test": TEST, "val": VAL}
    if args.quick:
        args.pretrain, args.sft_budget, args.rl, args.dpo = "1250", "700", "2m", "1m"
    if args.smoke:
        args.pretrain, args.sft_budget, args.rl, args.dpo = "100", "50", "20s", "30s"
        sizes = {"text": 5_000, "sft": 1_000, "tasks": 1_000, "pairs": 300, "test": 40, "val": 32}
        args.rl_flags, args.dpo_flags = f"{args.rl_flags} --eval-every 4", f"{args.dpo_flags} --eval-every 4"
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-feedback-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{cpu_model()}; load at the start {load()}; working in {work}", flush=True)
    files = make_data(work, args.seed, sizes, reverse=args.answers == "reversed")
    rows = []
    sft = args.sft or work / "sft"
    if args.sft is None:
        base = work / "base"
        train([str(files["sums.txt"]), "--tokenizer", "char", "--block-size", "64", "--n-layer", "4",
               *budget_flags(args.pretrain), "--out", str(base)], work, "pretrained the base")  # fmt: skip
        train(["--init-from", str(base), str(files["sft.jsonl"]), *budget_flags(args.sft_budget),
               "--out", str(sft)], work, "SFT")  # fmt: skip
    rows.append(("SFT (the start)", sft, None))
    start = exact_match(sft, files["val.jsonl"], work, samples=1)["greedy"]
    # exact-match RL learns only from groups where some sampled answer is right
    print(f"SFT exact match on the validation problems: {100 * start:.1f}%", flush=True)
    rl = f"{RL_FLAGS} {args.rl_flags}"
    runs = {
        "rl": ("RL, every weight", rl, files["tasks.jsonl"], files["val.jsonl"], args.rl),
        "lora": ("RL, LoRA", f"{rl} {args.lora_flags}", files["tasks.jsonl"], files["val.jsonl"], args.rl),
        "dpo": ("DPO, every weight", f"{DPO_FLAGS} {args.dpo_flags}", files["prefs.jsonl"],
                files["heldout-prefs.jsonl"], args.dpo),
    }  # fmt: skip
    for key, (name, flags, data, val, budget) in runs.items():
        if args.only and key not in args.only:
            continue
        out = work / key
        result = train(["--init-from", str(sft), str(data), "--val-file", str(val), "--max-time", budget,
                        "--out", str(out), *shlex.split(flags)], work, name)  # fmt: skip
        rows.append((name, out, result))
    report(rows, files, work)


def report(rows: list[tuple[str, Path, dict | None]], files: dict[str, Path], work: Path) -> None:
    print(f"\nscoring (load {load()})\n", flush=True)
    print(
        "| model | held-out exact match | pass@8 | held-out pairs: right sum likelier | steps | wall | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, run, result in rows:
        score = exact_match(run, files["test.jsonl"], work, samples=8)
        pref = likelier(run, files["heldout-prefs.jsonl"])
        records = metrics(run)
        last = [r for r in records if r["kind"] == "eval"]
        steps = max((r["step"] for r in records if "step" in r), default="-")
        wall = f"{result['wall']:.0f} s" if result else "-"
        print(f"| {name} | {100 * score['greedy']:.1f}% | {100 * score['pass_at_k']:.1f}% | {100 * pref:.1f}% | "
              f"{steps} | {wall} | {result['load'] if result else '-'} |")  # fmt: skip
        if result and last and "val_accuracy" in last[-1]:
            accuracy = ", ".join(f"{100 * r['val_accuracy']:.0f}%" for r in last)
            print(
                f"|  ↳ held-out preference accuracy at each evaluation (50% at the start) | {accuracy} |||||"
            )
    for name, run, result in rows:
        curve = reward_curve(run) if result else []
        if curve:
            print(f"\n{name}: reward curve\n\n| step | minutes | mean sampled reward | val exact match |")
            print("|---:|---:|---:|---:|")
            print("\n".join(curve))
    print(f"\nload at the end {load()}")


if __name__ == "__main__":
    main()
