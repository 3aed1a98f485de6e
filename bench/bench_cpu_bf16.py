"""bf16 autocast on the CPU: what torch's attention kernel costs in bf16, and a training step's time in float32
and bf16 by model width, which is what `--dtype auto` and
`minigpt.model.fused_attention.CPU_HALF_ATTENTION_MAX_KEYS` follow.

    python bench/bench_cpu_bf16.py                 # both tables, medians of 5 interleaved rounds
    python bench/bench_cpu_bf16.py --widths 128    # one width

Attention: forward and backward of `F.scaled_dot_product_attention` (causal) on bf16 inputs, once in bf16
and once cast up to float32 and the output back (what the model does over few keys). Steps: the CPU
recipe's real training step (`--arch modern`, Muon for the blocks' matrices, AdamW for the rest, clipping;
batch 16, the recipe's block) built in one process per row, rows interleaved, one step per row per round
after warm-up. Needs a CPU with bf16 instructions for the bf16 rows to mean anything (it says which).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import minigpt.model.fused_attention as model_module  # noqa: E402
from minigpt.common.device import cpu_has_bf16  # noqa: E402
from minigpt.model.gpt import GPT  # noqa: E402
from minigpt.model.presets import model_config  # noqa: E402
from minigpt.train.config import TrainConfig  # noqa: E402
from minigpt.train.optimizers import make_optimizer  # noqa: E402

SHAPES = [
    (16, 4, 64, 32),
    (16, 4, 128, 32),
    (16, 8, 128, 16),
    (8, 6, 256, 64),
    (16, 4, 512, 32),
    (4, 12, 1024, 64),
]


def median_ms(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each callable's median time (ms) over `rounds` interleaved rounds, after two warm-up calls each."""
    for run in runs.values():
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def attention(shape: tuple[int, int, int, int], upcast: bool) -> Callable[[], object]:
    q, k, v = (torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def run() -> None:
        if upcast:
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.sum().backward()

    return run


@contextlib.contextmanager
def attention_keys_limit(limit: int) -> Iterator[None]:
    """The model's float32-attention limit set to `limit` while a step runs (0: attention in bf16)."""
    before = model_module.CPU_HALF_ATTENTION_MAX_KEYS
    model_module.CPU_HALF_ATTENTION_MAX_KEYS = limit
    try:
        yield
    finally:
        model_module.CPU_HALF_ATTENTION_MAX_KEYS = before


def training_step(width: int, dtype: torch.dtype, keys_limit: int) -> Callable[[], object]:
    """The CPU recipe's step at this width (head size 32), in float32 or under bf16 autocast."""
    torch.manual_seed(0)
    recipe = TrainConfig().with_recipe("cpu")  # the CPU recipe's model and optimizers, as `train` builds them
    config = model_config(recipe.preset, recipe.arch, n_embd=width, n_head=width // 32, vocab_size=65)
    model = GPT(config)
    optimizer = make_optimizer(model, recipe)
    x = torch.randint(0, 65, (recipe.batch_size, config.block_size))
    y = torch.randint(0, 65, (recipe.batch_size, config.block_size))

    def run() -> None:
        with (
            attention_keys_limit(keys_limit),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32),
        ):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="64,96,128,192,256", help="model widths for the step table")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median shown)")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 instructions: {cpu_has_bf16()}"
    )

    print("\n| attention (batch, heads, keys, head size) | bf16 | cast to float32 | bf16 / float32 |")
    print("| --- | ---: | ---: | ---: |")
    for shape in SHAPES:
        t = median_ms({"bf16": attention(shape, False), "f32": attention(shape, True)}, args.rounds)
        print(f"| {shape} | {t['bf16']:.1f} ms | {t['f32']:.1f} ms | {t['bf16'] / t['f32']:.2f} |")

    limit = model_module.CPU_HALF_ATTENTION_MAX_KEYS
    print(
        "\n| width | float32 step | bf16, attention in bf16 | bf16 (attention as the model runs it) | float32 / bf16 |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for width in (int(w) for w in args.widths.split(",")):
        rows = {
            "f32": training_step(width, torch.float32, limit),
            "bf16 attention": training_step(width, torch.bfloat16, 0),
            "bf16": training_step(width, torch.bfloat16, limit),
        }
        t = median_ms(rows, args.rounds)
        print(
            f"| {width} | {t['f32']:.1f} ms | {t['bf16 attention']:.1f} ms | {t['bf16']:.1f} ms | "
            f"{t['f32'] / t['bf16']:.2f}x |"
        )


if __name__ == "__main__":
    main()
