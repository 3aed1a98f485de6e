"""Learning from feedback: preference pairs and DPO's loss, tasks, rewards and their failures, GRPO's
advantages, KL and loss, sampling through the decode loop, exact resume, and the CLI around them."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

from minigpt.chat.data import Skipped
from minigpt.chat.template import ChatTemplate, Message
from minigpt.common.files import load_tensors
from minigpt.data.dataset import DataConfig
from minigpt.errors import MinigptError, UsageError
from minigpt.feedback.answers import Answer, answer, call_seed
from minigpt.feedback.dpo import DirectPreference, PreferenceSplit, dpo_loss, prepare_preferences
from minigpt.feedback.grpo import (
    TaskData,
    TaskSplit,
    answer_batch,
    group_advantages,
    k3_kl,
    policy_loss,
    prepare_tasks,
    reference_tree,
)
from minigpt.feedback.logprobs import answer_logprobs
from minigpt.feedback.plan import planned_memory
from minigpt.feedback.records import PREFERENCES, TASKS, files_kind, parse_pair, parse_task
from minigpt.feedback.rewards import make_reward
from minigpt.generate.decode import Sampling, generate_uncached
from minigpt.generate.engines.numpy_engine import NumpyEngine
from minigpt.generate.engines.torch_engine import TorchEngine
from minigpt.generate.load import load_engine
from minigpt.model.config import GPTConfig
from minigpt.model.gpt import GPT
from minigpt.model.lora import trainable_count
from minigpt.model.memory import kv_cache_bytes
from minigpt.model.params import count_params
from minigpt.runs.folder import RunDir
from minigpt.train.finetune import plan_fine_tune
from minigpt.train.loop import TrainConfig, train

FAST = dict(batch_size=4, eval_iters=2, eval_every=4, log_every=2, warmup=2, device="cpu", dtype="float32")


def problems(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(a), int(b)) for a, b in rng.integers(10, 99, size=(n, 2))]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def tasks(n: int = 40) -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in problems(n)]


def pairs(n: int = 40) -> list[dict]:
    return [
        {"prompt": t["prompt"], "chosen": t["answer"], "rejected": str(int(t["answer"]) + 1)}
        for t in tasks(n)
    ]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny char model trained for a few steps on sums (every character the records use)."""
    root = tmp_path_factory.mktemp("base")
    text = root / "sums.txt"
    text.write_text("".join(f"{a}+{b}={a + b} ok\n" for a, b in problems(400, seed=1)))
    cfg = TrainConfig(**FAST, max_iters=12, preset="tiny", arch="modern", overrides={"block_size": 32})
    train(cfg, DataConfig(paths=(text,), tokenizer="char", cache_dir=root / "cache"), out=root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def template(base_run: Path) -> ChatTemplate:
    tokenizer, _, _ = plan_fine_tune(base_run, TrainConfig(), chat=True)
    return ChatTemplate(tokenizer)


def data(path: Path, tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(paths=(path,), cache_dir=tmp_path / "cache", **kw)


# ---------------------------------------------------------------------------------------------- records


def test_the_kind_of_a_file_comes_from_its_first_record(tmp_path: Path) -> None:
    prefs = write_jsonl(tmp_path / "p.jsonl", pairs(2))
    work = write_jsonl(tmp_path / "t.jsonl", tasks(2))
    bare = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1+1="}])
    assert files_kind([prefs]) == PREFERENCES and files_kind([work]) == TASKS
    assert files_kind([bare], reward=True) == TASKS  # a regex or a function needs no reference answer
    with pytest.raises(UsageError, match="holds preference pairs but .* holds tasks"):
        files_kind([prefs, work])


def test_a_pair_scores_only_the_answers(template: ChatTemplate) -> None:
    """Both shapes TRL reads, strings and messages alike: the targets are the answers' content and <|end|>."""
    system = {"role": "system", "content": "ok"}
    plain = {"prompt": "12+3=", "chosen": "15", "rejected": "16"}
    messages = {"messages": [system, {"role": "user", "content": "12+3="}],
                "chosen": [{"role": "assistant", "content": "15"}], "rejected": "16"}  # fmt: skip
    for record in (plain, messages):
        pair = parse_pair(json.dumps(record).encode(), template, 32)
        for (ids, targets), text in ((pair.chosen, "15"), (pair.rejected, "16")):
            scored = [i for i, t in zip(ids, targets, strict=True) if t]
            assert scored == [*template.tokenizer.encode(text), template.end_id]
            assert ids[: -len(scored) - 1][-1] == template.end_id  # the prompt closed before the answer
    prefixed = parse_pair(json.dumps(messages).encode(), template, 32).chosen[0]
    assert prefixed[0] == template.role_ids["system"]


HOSTILE_PAIRS = [
    ("{not json", "not a JSON record"),
    ({"prompt": "1+1=", "chosen": "2"}, 'no "rejected"'),
    ({"chosen": "2", "rejected": "3"}, 'neither "prompt" nor "messages"'),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "the same"),
    (
        {"prompt": "1+1=", "chosen": [{"role": "user", "content": "2"}], "rejected": "3"},
        "no assistant message",
    ),
    (
        {
            "prompt": "1+",
            "chosen": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}],
            "rejected": "3",
        },
        "starts with a user",
    ),  # fmt: skip
    ({"prompt": "1+1=", "chosen": 2, "rejected": "3"}, "not text"),
    ({"prompt": "1+1=", "chosen": "  ", "rejected": "3"}, "empty content"),
    (
        {
            "messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
            "chosen": "2",
            "rejected": "3",
        },
        "ends with an assistant message",
    ),  # fmt: skip
    ({"prompt": "1+1=" * 20, "chosen": "2", "rejected": "3"}, "more than the model's context of 32"),
    ({"prompt": "1+1=", "chosen": "2é", "rejected": "3"}, "never saw"),
    ({"prompt": "1+1=", "chosen": [], "rejected": "3"}, "not a non-empty list"),
    ('{"prompt": "1+1=", "chosen": "2", "rejected": "3", "n": ' + "9" * 5000 + "}", "5,000 digits"),
    (
        {"prompt": [{"type": "text", "text": None}], "chosen": "2", "rejected": "3"},
        "prompt: content part 1 has text None",
    ),
    (
        {
            "prompt": "1+1=",
            "rejected": "3",
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": {"a": 1}}]}],
        },
        "content part 1 has text {'a': 1}",
    ),  # fmt: skip
]


@pytest.mark.parametrize("record, why", HOSTILE_PAIRS, ids=[w for _, w in HOSTILE_PAIRS])
def test_a_bad_pair_is_one_line_naming_file_and_line_or_skipped(
    record: object, why: str, template: ChatTemplate, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "prefs.jsonl", [*pairs(4), "", record, *pairs(4)])
    with pytest.raises(MinigptError, match=rf"prefs.jsonl:6: .*{why}.*--skip-bad-records") as e:
        prepare_preferences(data(path, tmp_path), [path], 32, template.tokenizer)
    assert "\n" not in str(e.value)
    notes: list[str] = []
    kept = prepare_preferences(
        data(path, tmp_path, skip_bad_records=True), [path], 32, template.tokenizer, notes.append
    )
    assert kept.train.pairs + kept.val.pairs == 8 and "skipped 1 bad record(s)" in notes[0]


HOSTILE_TASKS = [
    ({"prompt": "1+1="}, 'no "answer"'),
    ({"prompt": "1+1=", "answer": ["2"]}, "not text"),
    ({"prompt": "1+1=" * 6, "answer": "2"}, "leaving less than the 8 answer tokens"),
    ({"answer": "2"}, 'neither "prompt" nor "messages"'),
]


@pytest.mark.parametrize("record, why", HOSTILE_TASKS, ids=[w for _, w in HOSTILE_TASKS])
def test_a_bad_task_is_a_bad_record(record: object, why: str, template: ChatTemplate) -> None:
    with pytest.raises(MinigptError, match=why):
        parse_task(json.dumps(record).encode(), template, 32, 8, need_answer=True)


@pytest.mark.parametrize("first", [True, False], ids=["first line", "later line"])
def test_strict_json_in_tasks_files_a_bad_number_or_part_is_one_line_or_skipped(
    first: bool, template: ChatTemplate, tmp_path: Path
) -> None:
    """A 5000-digit number or a null text part is the record's one-line error (even as the file's first
    record, which must not make a file of tasks read as conversations), and --skip-bad-records skips it."""
    huge = '{"prompt": "1+1=", "answer": ' + "9" * 5000 + "}"
    null_part = {"prompt": [{"type": "text", "text": None}], "answer": "2"}
    bad = [huge, null_part]
    records = [*bad, *tasks(8)] if first else [*tasks(8), *bad]
    path = write_jsonl(tmp_path / "tasks.jsonl", records)
    reward = make_reward("exact", 1.0)
    with pytest.raises(MinigptError, match=rf"tasks.jsonl:{1 if first else 9}: .*5,000 digits") as e:
        prepare_tasks(data(path, tmp_path), [path], 32, template.tokenizer, 8, reward)
    assert "\n" not in str(e.value)
    assert files_kind([path]) == TASKS
    notes: list[str] = []
    kept = prepare_tasks(
        data(path, tmp_path, skip_bad_records=True), [path], 32, template.tokenizer, 8, reward, notes.append
    )
    assert len(kept.train) + len(kept.val) == 8 and "skipped 2 bad record(s)" in notes[0]


def test_a_task_takes_a_number_as_its_answer_and_its_prompt_opens_the_answer(template: ChatTemplate) -> None:
    task = parse_task(b'{"prompt": "1+1=", "answer": 2, "level": 3}', template, 32, 8, need_answer=True)
    assert task.answer == "2" and task.record["level"] == 3
    assert task.prompt == template.prompt([Message("user", "1+1=")])


# ---------------------------------------------------------------------------------------------- DPO


def tiny_model(vocab: int = 24, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=vocab))


def test_the_dpo_loss_sums_log_probabilities_over_the_answers_only() -> None:
    """Against the formula written out here, position by position, with log_softmax over the vocabulary."""
    model, beta = tiny_model(), 0.3
    rows = [([1, 2, 3, 4, 5, 6], [False, False, False, True, True, True]),
            ([1, 2, 3, 7, 8], [False, False, False, True, True]),
            ([9, 2, 4, 5], [False, False, True, True]),
            ([9, 2, 4, 6, 6, 6, 7], [False, False, True, True, False, True, True])]  # fmt: skip
    split = PreferenceSplit.of(rows)
    split.reference = torch.tensor([-3.0, -2.5, -4.0, -1.0], dtype=torch.float64)
    x, y, ref = split.pair_batch([0, 1])
    policy = answer_logprobs(model, x, y).double()
    losses, margin = dpo_loss(policy, ref, beta)

    def logp(ids: list[int], targets: list[bool]) -> float:
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids[:-1]]), all_logits=True)
        lp = torch.log_softmax(logits[0].double(), -1)
        return sum(lp[t - 1, ids[t]].item() for t in range(1, len(ids)) if targets[t])

    ref_logps = split.reference.tolist()
    for p in range(2):
        (c, ct), (r, rt) = rows[2 * p], rows[2 * p + 1]
        z = beta * ((logp(c, ct) - ref_logps[2 * p]) - (logp(r, rt) - ref_logps[2 * p + 1]))
        assert margin[p].item() == pytest.approx(z, rel=1e-5)
        assert losses[p].item() == pytest.approx(-math.log(1 / (1 + math.exp(-z))), rel=1e-5)


def test_the_dpo_loss_starts_at_log_2_and_ties_rank_half() -> None:
    model = tiny_model()
    split = PreferenceSplit.of([([1, 2, 3], [False, True, True]), ([1, 2, 4], [False, True, True])] * 3)
    dpo = DirectPreference.__new__(DirectPreference)
    dpo.beta = 0.1
    from minigpt.train.step import Runtime

    runtime = Runtime(torch.device("cpu"), torch.float32)
    split.reference.copy_(dpo._logprobs(model, split, range(split.pairs), 2, runtime).double())
    score = dpo.score(model, split, 2, 4, runtime)
    assert score.loss == pytest.approx(math.log(2)) and score.accuracy == 0.5 and score.margin == 0.0


# ---------------------------------------------------------------------------------------------- GRPO


def test_group_advantages_are_each_reward_against_its_group() -> None:
    rewards = torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]], dtype=torch.float64
    )
    got = group_advantages(rewards)
    for row, out in zip(rewards.numpy(), got.numpy(), strict=True):
        expect = (row - row.mean()) / (row.std(ddof=1) + 1e-4)
        np.testing.assert_allclose(out, expect, rtol=1e-12)
    assert (got[1] == 0).all()  # a group that scores alike teaches nothing


def test_the_k3_term_is_never_negative_and_its_mean_under_the_policy_is_the_kl() -> None:
    p = torch.softmax(torch.tensor([1.0, -0.5, 2.0, 0.3], dtype=torch.float64), 0)
    q = torch.softmax(torch.tensor([0.2, 0.1, 1.0, -1.0], dtype=torch.float64), 0)
    k3 = k3_kl(p.log(), q.log())
    assert (k3 >= 0).all()
    kl = (p * (p.log() - q.log())).sum()
    assert (p * k3).sum().item() == pytest.approx(kl.item(), rel=1e-12)  # E_p[q/p - log(q/p) - 1] = KL(p||q)
    assert k3_kl(p.log(), p.log()).abs().max() == 0


def test_the_policy_loss_is_the_policy_gradient_plus_the_kl_over_answer_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    ref = torch.log_softmax(torch.randn(3, 5), -1)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 2.0])
    loss, kl = policy_loss(logp, ref, adv, mask, kl_coef=0.1)
    n = mask.sum()
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    assert loss.item() == pytest.approx(((-adv[:, None] + 0.1 * k3) * mask).sum().item() / n.item(), rel=1e-6)
    assert kl.item() == pytest.approx((k3 * mask).sum().item() / n.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logits)
    expect_logits = logits.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(expect_logits, -1)
    surrogate = ((-adv[:, None] * lp + 0.1 * (torch.exp(ref - lp) - (ref - lp) - 1)) * mask).sum() / n
    (expect,) = torch.autograd.grad(surrogate, expect_logits)
    torch.testing.assert_close(grad, expect)


def test_an_answer_batch_predicts_only_the_answers() -> None:
    groups = [[Answer([7, 8, 2], "", True), Answer([9], "", False)], [Answer([5, 2], "", True)]]
    x, y = answer_batch([[1, 2, 3], [4, 5]], groups, 16)
    assert x.shape == (3, 5)  # as wide as the longest answer after its prompt
    assert x[0].tolist() == [1, 2, 3, 7, 8] and y[0].tolist() == [-1, -1, 7, 8, 2]
    assert y[1].tolist() == [-1, -1, 9, -1, -1] and y[2].tolist() == [-1, 5, 2, -1, -1]


def test_the_reference_of_a_lora_model_is_the_starting_model(base_run: Path, tmp_path: Path) -> None:
    from minigpt.train.finetune import lora_model

    _, shape, link = plan_fine_tune(base_run, TrainConfig(lora_rank=2), chat=True)
    model = lora_model(shape, link, tmp_path, torch.device("cpu"), fresh=True)
    copies = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    tree = reference_tree(model, copies)
    x = torch.randint(0, shape.vocab_size, (2, 8))
    with torch.no_grad():
        start, _ = model(x, all_logits=True)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5)
        moved, _ = model(x, all_logits=True)
        kept, _ = model(x, all_logits=True, weights=tree)
    assert not torch.equal(start, moved) and torch.equal(start, kept)


# ---------------------------------------------------------------------------------------------- rewards


def test_exact_and_regex_rewards() -> None:
    from minigpt.feedback.records import Task

    task = Task([1], " 42", {})
    assert make_reward("exact", 1)("42 ", task) == 1.0 and make_reward("exact", 1)("4 2", task) == 0.0
    assert (
        make_reward(r"regex:^\d+$", 1)("42", task) == 1.0
        and make_reward(r"regex:^\d+$", 1)("4x", task) == 0.0
    )
    with pytest.raises(UsageError, match="not a regular expression"):
        make_reward("regex:(", 1)
    with pytest.raises(UsageError, match="unknown --reward"):
        make_reward("close", 1)


def raises(answer: str, record: dict) -> float:
    raise KeyError("no such field")


FAILURES = {
    "raises": (lambda release: raises, r"raised KeyError: 'no such field'"),
    "a string": (lambda release: lambda a, r: "1", r"returned '1' \(str\): a reward must be a finite number"),
    "None": (lambda release: lambda a, r: None, r"returned None \(NoneType\)"),
    "NaN": (lambda release: lambda a, r: float("nan"), r"returned nan \(float\)"),
    "blocks": (
        lambda release: lambda a, r: release.wait(),
        r"took longer than 0.05 s on one answer \(--reward-timeout\)",
    ),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_a_reward_function_that_fails_is_one_line_naming_it(failure: str, monkeypatch) -> None:
    from minigpt.feedback.records import Task

    make, why = FAILURES[failure]
    release = threading.Event()
    monkeypatch.setattr(sys.modules[__name__], "user_reward", make(release), raising=False)
    reward = make_reward(f"{__name__}:user_reward", 0.05)
    try:
        with pytest.raises(MinigptError, match=f"^reward {__name__}:user_reward {why}") as e:
            reward("2", Task([1], None, {}))
    finally:
        release.set()  # the given-up call returns, and its thread waits for the next
    assert "\n" not in str(e.value)


def test_a_reward_function_gets_the_record_and_counts_a_bool(tmp_path: Path) -> None:
    from minigpt.feedback.records import Task

    module = tmp_path / "my_reward.py"
    module.write_text("def wide(answer, record):\n    return len(answer) >= record['width']\n")
    reward = make_reward(f"{module}:wide", 1.0)
    assert (
        reward("abc", Task([1], None, {"width": 3})) == 1.0
        and reward("ab", Task([1], None, {"width": 3})) == 0.0
    )
    with pytest.raises(UsageError, match="has no function nope"):
        make_reward(f"{module}:nope", 1.0)
    with pytest.raises(UsageError, match="cannot import no_such_module_here"):
        make_reward("no_such_module_here:f", 1.0)


# ---------------------------------------------------------------------------------------------- sampling


def test_answers_come_from_the_decode_loop_and_both_engines_answer_greedily_alike(base_run: Path) -> None:
    torch_engine, tokenizer = load_engine(base_run, "torch", threads=1)
    numpy_engine, _ = load_engine(base_run, "numpy", threads=1)
    assert isinstance(torch_engine, TorchEngine) and isinstance(numpy_engine, NumpyEngine)
    prompts = [tokenizer.encode(p) for p in ("12+34=", "5+67=", "88+1=", "40+40=")]  # two lengths
    stop = {tokenizer.encode("\n")[0]}
    greedy = [answer(e, tokenizer, prompts, samples=1, max_tokens=6, stop_ids=stop, sampling=Sampling(0.0))
              for e in (torch_engine, numpy_engine)]  # fmt: skip
    assert [[a.ids for a in g] for g in greedy[0]] == [[a.ids for a in g] for g in greedy[1]]
    # sampled: each decode call (the prompts of one length) draws as the reference loop does from its seed
    sampling = Sampling(1.0, seed=7)
    got = answer(
        torch_engine, tokenizer, prompts, samples=3, max_tokens=5, stop_ids=(), sampling=sampling, rows=4
    )
    calls = [[0], [1], [2], [3]]  # 4 rows a call: one prompt of 3 samples each
    for members in calls:
        rows = [prompts[i] for i in members for _ in range(3)]
        seed = call_seed(7, members[0])
        steps = generate_uncached(torch_engine, rows, 5, sampling=Sampling(1.0, seed=seed))
        expect = [[steps[t][r] for t in range(5)] for r in range(len(rows))]
        assert [a.ids for i in members for a in got[i]] == expect


# ---------------------------------------------------------------------------------------------- training


def test_a_dpo_run_learns_its_pairs_and_is_an_ordinary_run(base_run: Path, tmp_path: Path, runner) -> None:
    from minigpt.cli.main import app

    # pairs a tiny model can tell apart without adding: the rejected answer is always "ok"
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [{**p, "rejected": "ok"} for p in pairs(40)])
    cfg = TrainConfig(**{**FAST, "max_iters": 12, "eval_every": 6, "dpo_beta": 0.5})
    result = train(cfg, data(prefs, tmp_path), out=tmp_path / "dpo", init_from=base_run)
    evals = [r for r in result.metrics if r["kind"] == "eval"]
    assert {"val_accuracy", "val_margin", "val_loss", "train_loss"} <= set(evals[-1])
    assert evals[-1]["val_loss"] < math.log(2) and evals[-1]["val_accuracy"] == 1.0
    out = runner.invoke(app, ["chat", str(tmp_path / "dpo"), "-t", "0", "-n", "4"], input="1+2=\n")
    assert out.exit_code == 0, out.output


@pytest.fixture(scope="module")
def cli_dpo_run(base_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`minigpt train --init-from RUN prefs.jsonl` as a user types it, with no rate given."""
    from typer.testing import CliRunner

    from minigpt.cli.main import app

    root = tmp_path_factory.mktemp("cli-dpo")
    prefs = write_jsonl(root / "prefs.jsonl", pairs(16))
    args = ["train", "--init-from", str(base_run), str(prefs), "--max-iters", "2", "--batch-size", "2",
            "--eval-iters", "1", "--device", "cpu", "--dtype", "float32", "--out", str(root / "dpo")]  # fmt: skip
    result = CliRunner().invoke(app, args, env={"MINIGPT_CACHE_DIR": str(root / "cache")})
    assert result.exit_code == 0, result.output
    return root / "dpo"


def test_a_dpo_run_given_no_rates_takes_the_small_ones_and_records_them(cli_dpo_run: Path) -> None:
    """The data's kind chooses the rates a run is given none of (the CPU's beta1 and head share kept),
    and config.json says what they were."""
    saved = RunDir(cli_dpo_run).read_config()["train"]
    assert (saved["optimizer"], saved["lr"], saved["beta1"], saved["head_lr"]) == ("adamw", 1e-4, 0.8, 2.5e-5)
    assert TrainConfig.from_dict(saved) == TrainConfig.from_dict(saved).with_recipe("cpu")  # resolved


def test_serve_loads_a_dpo_run_and_answers_from_it(cli_dpo_run: Path) -> None:
    """In process: the run's engine and batcher (`load_models`, as `serve` builds them), the application
    over them, a chat completion and the run's page data."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
    from fastapi.testclient import TestClient

    from minigpt.generate.config import EngineConfig
    from minigpt.serve.app import create_app
    from minigpt.serve.config import ServeConfig
    from minigpt.serve.models import load_models

    models = load_models([cli_dpo_run], EngineConfig(device="cpu"), ServeConfig())
    with TestClient(create_app(models)) as client:
        body = {"model": "dpo", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
        info = client.get("/v1/runs/dpo")
        assert info.status_code == 200, info.text
        assert any("val_accuracy" in r for r in info.json()["metrics"])


def test_exact_resume_of_an_rl_run_is_bitwise(base_run: Path, tmp_path: Path) -> None:
    work = write_jsonl(tmp_path / "tasks.jsonl", tasks(40))
    cfg = TrainConfig(**{**FAST, "max_iters": 6, "eval_every": 3, "group_size": 3, "answer_tokens": 4,
                         "lora_rank": 2})  # fmt: skip
    straight = train(cfg, data(work, tmp_path), out=tmp_path / "straight", init_from=base_run)

    def stop_at_3(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    first = train(cfg, data(work, tmp_path), out=tmp_path / "split", init_from=base_run, on_step=stop_at_3)
    assert first.interrupted and first.state.step == 3
    resumed = train(TrainConfig(), resume=tmp_path / "split")
    assert resumed.state.step == 6
    a, _ = load_tensors(tmp_path / "straight" / RunDir.STATE)
    b, _ = load_tensors(tmp_path / "split" / RunDir.STATE)
    assert a.keys() == b.keys() and any(k.startswith("reference/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    steps = [r for r in straight.metrics if r["kind"] == "train"]
    assert {"reward", "reward_std", "kl"} <= set(steps[-1])
    last = [r for r in resumed.metrics if r["kind"] == "train"][-1]
    assert all(last[k] == steps[-1][k] for k in ("step", "tokens", "loss", "reward", "reward_std", "kl"))


def test_rl_is_refused_what_it_cannot_do(base_run: Path, tmp_path: Path) -> None:
    work = write_jsonl(tmp_path / "tasks.jsonl", tasks(8))
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "1+1=", "completion": "2"}] * 8)
    with pytest.raises(UsageError, match="starts from a trained run: name it with --init-from"):
        train(TrainConfig(**FAST, max_iters=1), data(work, tmp_path), out=tmp_path / "a")
    with pytest.raises(UsageError, match="--group-size is for tasks, not conversations"):
        train(TrainConfig(**FAST, max_iters=1, group_size=4), data(chat, tmp_path), out=tmp_path / "b",
              init_from=base_run)  # fmt: skip
    with pytest.raises(UsageError, match="--dpo-beta is for preference pairs, not tasks"):
        train(TrainConfig(**FAST, max_iters=1, dpo_beta=0.5), data(work, tmp_path), out=tmp_path / "c",
              init_from=base_run)  # fmt: skip


def test_rl_through_the_cli_with_a_python_reward_and_eval_of_the_tasks(
    base_run: Path, tmp_path: Path
) -> None:
    """Real processes: a module:function reward from the current folder, then `minigpt eval` of the tasks;
    a reward that fails stops the run with one line."""
    write_jsonl(tmp_path / "tasks.jsonl", [{**t, "width": 2} for t in tasks(16)])
    (tmp_path / "rewards.py").write_text(
        "def width(answer, record):\n    return len(answer.strip()) == record['width']\n"
        "def broken(answer, record):\n    return 'yes'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIGPT_CACHE_DIR": str(tmp_path / "cache")}
    base = ["train", "--init-from", str(base_run), "tasks.jsonl", "--max-iters", "2", "--batch-size", "2",
            "--group-size", "2", "--answer-tokens", "4", "--eval-iters", "1", "--device", "cpu"]  # fmt: skip

    def minigpt(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "minigpt", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240)  # fmt: skip

    ok = minigpt(*base, "--reward", "rewards:width", "--out", "rl")
    assert ok.returncode == 0, ok.stderr
    assert "reward" in ok.stderr and "kl" in ok.stderr and "val reward" in ok.stderr
    bad = minigpt(*base, "--reward", "rewards:broken", "--out", "bad")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == (
        "error: reward rewards:broken returned 'yes' (str): a reward must be a finite number"
    )
    assert "Traceback" not in bad.stderr
    scored = minigpt("eval", "rl", "tasks.jsonl", "--samples", "3", "--answer-tokens", "4", "--json")
    assert scored.returncode == 0, scored.stderr
    report = json.loads(scored.stdout)
    assert (
        report["tasks"] == 16 and report["reward"] == "exact" and 0 <= report["greedy"] <= report["pass_at_k"]
    )


def test_memory_counts_rl_reference_and_cache(base_run: Path) -> None:
    tokenizer, shape, link = plan_fine_tune(base_run, TrainConfig(lora_rank=2), chat=True)
    fake = TaskData(tokenizer, TaskSplit([]), TaskSplit([]), 0, 0, (), Skipped())
    cfg = TrainConfig(batch_size=3, group_size=5)
    rows, extra = planned_memory(cfg, shape, fake, None)
    assert rows == 15 and extra == 4 * count_params(shape).exact_total + kv_cache_bytes(shape, 15)
    _, lora_extra = planned_memory(cfg, shape, fake, link.lora)
    assert lora_extra == 4 * trainable_count(shape, link.lora) + kv_cache_bytes(shape, 15)


def test_without_a_kl_term_answers_that_teach_nothing_are_left_out_alike() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 6, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    mask = torch.ones(4, 6, dtype=torch.bool)
    adv = torch.tensor([0.0, 1.5, 0.0, -1.5])
    whole, _ = policy_loss(logp, None, adv, mask, 0.0)
    keep = adv != 0
    part, kl = policy_loss(logp[keep], None, adv[keep], mask[keep], 0.0, tokens=int(mask.sum()))
    assert part.item() == pytest.approx(whole.item()) and kl.item() == 0
    (a,) = torch.autograd.grad(part, logits, retain_graph=True)
    (b,) = torch.autograd.grad(whole, logits)
    torch.testing.assert_close(a, b)


def test_rl_without_a_kl_term_keeps_no_reference(base_run: Path, tmp_path: Path) -> None:
    work = write_jsonl(tmp_path / "tasks.jsonl", tasks(16))
    cfg = TrainConfig(**{**FAST, "max_iters": 2, "group_size": 2, "answer_tokens": 4, "kl_coef": 0.0})
    result = train(cfg, data(work, tmp_path), out=tmp_path / "rl", init_from=base_run)
    state, _ = load_tensors(tmp_path / "rl" / RunDir.STATE)
    assert not any(k.startswith("reference/") for k in state)
    step = [r for r in result.metrics if r["kind"] == "train"][-1]
    assert "reward" in step and "kl" not in step
    card = (tmp_path / "rl" / RunDir.CARD).read_text()
    assert "best val reward" in card and "nats per token" not in card


@pytest.mark.slow
def test_a_lora_rl_run_merges_and_exports_like_any_run(base_run: Path, tmp_path: Path, runner) -> None:
    """An RL run with LoRA: `convert to-hf` (transformers gives its logits and the chat template),
    `convert to-gguf` (the template), `convert merge` to a plain run that `generate` and `eval` read."""
    from minigpt.cli.main import app

    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    work = write_jsonl(tmp_path / "tasks.jsonl", tasks(16))
    cfg = TrainConfig(**{**FAST, "max_iters": 2, "group_size": 2, "answer_tokens": 4, "lora_rank": 2})
    train(cfg, data(work, tmp_path), out=tmp_path / "rl", init_from=base_run)
    run = tmp_path / "rl"
    model, tokenizer, _ = RunDir(run).load_model()  # the base with the adapter merged
    ids = ChatTemplate(tokenizer).prompt([Message("user", "12+34=")])

    assert runner.invoke(app, ["convert", "to-hf", str(run), str(tmp_path / "hf")]).exit_code == 0
    with torch.no_grad():
        want, _ = model(torch.tensor([ids]))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        got = hf(torch.tensor([ids])).logits[:, -1]
    assert torch.allclose(got, want.reshape(got.shape), atol=1e-4, rtol=0)
    assert "chat_template" in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())

    out = runner.invoke(app, ["convert", "to-gguf", str(run), str(tmp_path / "rl.gguf")])
    assert out.exit_code == 0, out.output
    reader = gguf.GGUFReader(tmp_path / "rl.gguf")
    assert reader.fields["tokenizer.chat_template"].contents() == ChatTemplate.jinja()

    merged = tmp_path / "merged"
    out = runner.invoke(app, ["convert", "merge", str(run), "--out", str(merged)])
    assert out.exit_code == 0, out.output
    plain, _, _ = RunDir(merged).load_model()
    for (name, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    out = runner.invoke(app, ["generate", "12+", "--model", str(merged), "-n", "4", "-t", "0"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["eval", str(merged), str(work), "--answer-tokens", "4", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["tasks"] == 16
