"""minigpt's AdamW against torch.optim.AdamW(fused=True), the reference it replaces (the untied head's own
rate too), and a `train` command that never imports torch._dynamo (torch.optim's base class would, 1.5 s
of every start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.cli.main import app
from minigpt.feedback.kinds import CONVERSATIONS, PREFERENCES, TASKS
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.train.adamw import AdamW
from minigpt.train.config import TrainConfig
from minigpt.train.optimizers import make_optimizer


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _steps(opt, params: list[torch.Tensor], lrs: list[float]) -> None:
    g = torch.Generator().manual_seed(99)
    for k, lr in enumerate(lrs):
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        for n, p in enumerate(params):
            # one parameter has no gradient on odd steps: it must keep its state and count unchanged
            p.grad = None if (n == 3 and k % 2) else torch.randn(p.shape, generator=g)
        opt.step()
        opt.zero_grad()


def test_adamw_bitwise_equals_torch_fused_adamw() -> None:
    ours, theirs = _params(0), _params(0)

    def groups(ps: list[torch.Tensor]) -> list[dict]:
        return [
            {"params": ps[:2], "weight_decay": 0.1, "lr_scale": 1.0},
            {"params": ps[2:], "weight_decay": 0.0, "lr_scale": 0.5},
        ]

    mine = AdamW(groups(ours), lr=1e-2, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(groups(theirs), lr=1e-2, betas=(0.9, 0.95), fused=True)
    lrs = [1e-2, 8e-3, 3e-3, 1e-3, 0.0, 5e-3]
    _steps(mine, ours, lrs)
    _steps(ref, theirs, lrs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mine.state[a][key], ref.state[b][key]), key
            assert mine.state[a][key].dtype == ref.state[b][key].dtype


def test_zero_grad_keeps_or_drops_gradients() -> None:
    (p,) = _params(1)[:1]
    opt = AdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and not p.grad.any()
    opt.zero_grad()
    assert p.grad is None


@pytest.mark.slow
def test_train_never_imports_the_compiler(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    code = (
        "import sys\n"
        "from minigpt.cli.main import main\n"
        "sys.argv = ['minigpt', 'train', sys.argv[1], '--tokenizer', 'char', '--max-iters', '3', '--n-layer', '1',"
        " '--n-embd', '16', '--n-head', '2', '--block-size', '16', '--optimizer', 'muon', '--out', sys.argv[2]]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(text), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def _model(tie: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, tie_embeddings=tie))


# (device, data, LoRA) -> (optimizer, lr, beta1, head_lr, schedule, grad_clip) with_recipe fills in: the
# CPU's text and conversations train unclipped, everything measured with clipping at 1 keeps it
RATES_BY_KIND = [
    ("cpu", None, False, ("muon", 1.6e-2, 0.8, 4e-3, "wsd", 0.0)),
    ("cpu", CONVERSATIONS, False, ("muon", 1.6e-2, 0.8, 4e-3, "wsd", 0.0)),
    ("cpu", CONVERSATIONS, True, ("muon", 8e-3, 0.9, 8e-3, "wsd", 1.0)),
    ("cpu", PREFERENCES, False, ("adamw", 1e-4, 0.8, 2.5e-5, "wsd", 1.0)),
    ("cpu", TASKS, False, ("adamw", 3e-4, 0.8, 7.5e-5, "wsd", 1.0)),
    ("cpu", PREFERENCES, True, ("adamw", 1e-3, 0.9, 1e-3, "wsd", 1.0)),
    ("cpu", TASKS, True, ("adamw", 1e-3, 0.9, 1e-3, "wsd", 1.0)),
    ("cuda", None, False, ("adamw", 1e-3, 0.9, 1e-3, "cosine", 1.0)),
    ("cuda", CONVERSATIONS, True, ("adamw", 1e-3, 0.9, 1e-3, "cosine", 1.0)),
    ("cuda", PREFERENCES, False, ("adamw", 1e-4, 0.9, 1e-4, "cosine", 1.0)),
    ("cuda", TASKS, False, ("adamw", 3e-4, 0.9, 3e-4, "cosine", 1.0)),
    ("cuda", PREFERENCES, True, ("adamw", 1e-3, 0.9, 1e-3, "cosine", 1.0)),
    ("mps", TASKS, True, ("adamw", 1e-3, 0.9, 1e-3, "cosine", 1.0)),
]


@pytest.mark.parametrize(("device", "data", "lora", "want"), RATES_BY_KIND)
def test_preference_pairs_and_tasks_get_small_rates_on_any_device(
    device: str, data: str | None, lora: bool, want: tuple
) -> None:
    cfg = TrainConfig(lora_rank=8 if lora else None).with_recipe(device, data)
    assert (cfg.optimizer, cfg.lr, cfg.beta1, cfg.head_lr, cfg.schedule, cfg.grad_clip) == pytest.approx(want)
    assert cfg.min_lr == pytest.approx(cfg.lr / 10 if cfg.schedule == "cosine" else 0.0)


def test_the_rates_given_win_over_the_datas() -> None:
    given = dict(
        optimizer="muon", lr=5e-3, beta1=0.95, head_lr=2e-3, muon_lr=0.01, schedule="cosine", grad_clip=0.5
    )
    for device in ("cpu", "cuda"):
        for data in (PREFERENCES, TASKS):
            for lora in (None, 4):
                cfg = TrainConfig(**given, lora_rank=lora).with_recipe(device, data)
                assert {k: getattr(cfg, k) for k in given} == given
    # the rest still comes from the data's kind: a head learns at its share of the lr given
    cfg = TrainConfig(lr=2e-4).with_recipe("cpu", PREFERENCES)
    assert (cfg.optimizer, cfg.beta1, cfg.head_lr) == ("adamw", 0.8, 5e-5)
    assert TrainConfig(optimizer="muon").with_recipe("cpu", TASKS).lr == 3e-4


def test_an_untied_head_learns_at_head_lr_with_the_recipes_beta1() -> None:
    cfg = TrainConfig(optimizer="muon", head_lr=2e-3).with_recipe("cpu")
    assert (cfg.lr, cfg.beta1) == (1.6e-2, 0.8)
    model = _model(tie=False)
    head = model.lm_head.weight
    ref_head = head.detach().clone().requires_grad_()
    opt = make_optimizer(model, cfg)
    ref = torch.optim.AdamW(
        [ref_head], lr=2e-3, betas=(0.8, cfg.beta2), weight_decay=cfg.weight_decay, fused=True
    )
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        ref_head.grad = head.grad.clone()
        opt.set_lr(cfg.lr)
        opt.step()
        ref.step()
    assert torch.equal(head, ref_head)


def test_the_rates_default_by_recipe_and_a_tied_head_keeps_lr() -> None:
    assert TrainConfig(lr=1e-2).with_recipe("cpu").head_lr == 2.5e-3
    assert TrainConfig(lr=1e-2).with_recipe("cuda").head_lr == 1e-2
    assert TrainConfig().with_recipe("cuda").beta1 == 0.9
    # LoRA's adapters keep the CPU rates they were tuned at; a GPU's recipe is the same with or without
    lora = TrainConfig(lora_rank=4).with_recipe("cpu")
    assert (lora.lr, lora.beta1, lora.head_lr, lora.muon_lr) == (8e-3, 0.9, 8e-3, 0.012)
    assert TrainConfig(lora_rank=4).with_recipe("cuda") == TrainConfig(lora_rank=4, lr=1e-3).with_recipe(
        "cuda"
    )
    # a run saved before the head had its own rate trained it at lr, and resumes so
    assert TrainConfig.from_dict({"lr": 3e-3, "beta1": 0.9}).head_lr == 3e-3
    opt = make_optimizer(_model(tie=True), TrainConfig(optimizer="adamw").with_recipe("cpu"))
    scales = {id(p): group["lr_scale"] for group in opt.param_groups for p in group["params"]}
    assert all(scale == 1.0 for scale in scales.values())


def test_bad_rates_are_one_line_usage_errors(runner, tmp_path: Path) -> None:
    for flags, message in (
        (["--head-lr", "0"], "head_lr must be positive, got 0.0"),
        (["--beta1", "1"], "beta1 and beta2 must be in [0, 1), got 1.0, 0.99"),
    ):
        text = tmp_path / "t.txt"
        text.write_text("some text " * 50)
        out = tmp_path / "run"
        result = runner.invoke(app, ["train", str(text), "--tokenizer", "char", "--out", str(out), *flags])
        assert result.exit_code == 2 and message in result.output, result.output
        assert not out.exists()
