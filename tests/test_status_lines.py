"""Status lines say what is so: tokenizing still going on only while it does, a stop that lost nothing says
nothing, a changed file is named once as changed, `params` counts a Muon run's training memory as Muon
keeps it, and the recipe records the warmup the run used. (A bpe tokenizer's note on a compressed file:
tests/test_progress.py.)"""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
from test_corpus import bpe_file, many_docs, small_chunks  # noqa: F401  (fixtures)
from test_train import TEXT, TINY, tiny_cfg, training_start

import minigpt.corpus.encode as encode
import minigpt.corpus.ingest as ingest
import minigpt.train.run as run_module
from minigpt.cli.main import app
from minigpt.data.dataset import DataConfig, prepare_data
from minigpt.errors import MinigptError
from minigpt.runs.folder import RunDir
from minigpt.train.checkpoint import TrainState
from minigpt.train.loop import TrainConfig, train
from minigpt.train.optimizers import make_optimizer
from minigpt.train.reporters import LineReporter, header_text


def test_the_header_says_so_far_only_while_tokenizing_goes_on() -> None:
    status: list[str | None] = ["tokenizing: 1.0 MB of 2.0 GB (0%), 9.0 MB/s, 3:40 left"]
    info = training_start(TrainState())
    going = header_text(type(info)(**{**info.__dict__, "data_status": lambda: status[0]}))
    assert "1,003,855 train (so far: tokenizing goes on) / 111,539 val tokens" in going
    status[0] = None  # done by the time the header is written
    done = header_text(type(info)(**{**info.__dict__, "data_status": lambda: status[0]}))
    assert "1,003,855 train / 111,539 val tokens" in done and "so far" not in done


def test_a_corpus_tokenized_during_start_up_is_counted_whole_in_the_header(
    tmp_path: Path,
    bpe_file: Path,  # noqa: F811
    small_chunks: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The training split starts with what was ready when the split was made (the validation part and
    the first training part; the rest is held back here); tokenizing then finishes during start-up, before
    the header: the header counts every training token and does not say tokenizing goes on."""
    root = many_docs(tmp_path)
    data = DataConfig(paths=(root,), tokenizer=str(bpe_file), cache_dir=tmp_path / "cache")
    gate, first_entries = threading.Event(), []
    real_close, real_reserve = encode._close, run_module._reserve_time

    def held_close(entry, chunk, failed, unchanged):  # noqa: ANN001, ANN202
        if entry not in first_entries and len(first_entries) < 2:
            first_entries.append(entry)  # the validation part, then the first training part
        if entry not in first_entries:
            gate.wait()
        return real_close(entry, chunk, failed, unchanged)

    def reserve_once_tokenized(run):  # noqa: ANN001, ANN202
        gate.set()
        ingest = run.dataset.ingest
        with ingest._cond:  # the worker notifies as it finishes each part
            ingest._cond.wait_for(ingest.done_all)
        return real_reserve(run)

    monkeypatch.setattr(encode, "_close", held_close)
    monkeypatch.setattr(run_module, "_reserve_time", reserve_once_tokenized)
    log = io.StringIO()
    train(tiny_cfg(max_iters=1), data, out=tmp_path / "run", reporter=LineReporter(log))
    monkeypatch.undo()
    header = log.getvalue()
    assert "so far" not in header, header
    counted = int(header.split("data: ")[1].split(" train")[0].replace(",", ""))
    whole = prepare_data(data, 32, progress=False)  # the store holds it all now: read whole, at once
    assert whole.complete and counted == len(whole.train)


def test_a_text_too_short_says_so_and_not_that_tokenizing_stopped(
    runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The text is tokenized whole, then found too short: the error says so and what to do; the stop that
    follows catches the worker recording the file's hash (held here until it does), which loses nothing
    and says nothing."""
    short = tmp_path / "short.txt"
    short.write_text(TEXT[:300], encoding="utf-8")

    def hash_until_stopped(path: Path, advance) -> str:  # noqa: ANN001
        while True:
            advance(0)  # raises Stopped once the run stops tokenizing
            time.sleep(0.01)

    monkeypatch.setattr(ingest, "file_sha256", hash_until_stopped)
    result = runner.invoke(
        app, ["train", str(short), *TINY, "--max-iters", "2", "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 1, result.output
    assert "tokenizing stopped" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: the text is only ") and "too short for --block-size 32" in last
    assert "use --block-size" in last or "give more text" in last


def test_a_resume_on_an_edited_file_names_it_once_as_changed(runner, tmp_path: Path) -> None:
    text = tmp_path / "tiny.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "run"
    assert (
        runner.invoke(app, ["train", str(text), *TINY, "--max-iters", "2", "--out", str(out)]).exit_code == 0
    )
    text.write_text(TEXT + "one more line\n", encoding="utf-8")
    result = runner.invoke(app, ["train", "--resume", str(out), "--max-iters", "3"])
    assert result.exit_code == 1
    assert "(changed: tiny.txt)" in result.stderr and "new:" not in result.stderr, result.stderr


def _run(tmp_path: Path, name: str, **kw) -> Path:
    text = tmp_path / "tiny.txt"
    text.write_text(TEXT, encoding="utf-8")
    train(tiny_cfg(**kw), DataConfig(paths=(text,), cache_dir=tmp_path / "cache"), out=tmp_path / name)
    return tmp_path / name


def test_params_counts_a_muon_runs_training_memory_as_muon_keeps_it(runner, tmp_path: Path) -> None:
    """Muon keeps one momentum buffer for the blocks' matrices where AdamW keeps two moments: the reference
    is the optimizer the run builds, its Muon group's parameters."""
    muon, adamw = (
        _run(tmp_path, "muon", optimizer="muon", max_iters=2),
        _run(tmp_path, "adamw", optimizer="adamw", max_iters=2),
    )
    model, _, _ = RunDir(muon).load_model()
    cfg = TrainConfig(optimizer="muon").with_recipe("cpu")
    optimizer = make_optimizer(model, cfg)
    in_muon = sum(p.numel() for part in optimizer.parts[1:] for g in part.param_groups for p in g["params"])
    total = sum(p.numel() for p in model.parameters())
    assert 0 < in_muon < total
    shown = runner.invoke(app, ["params", str(muon), "--json"])
    memory = json.loads(shown.stdout)["memory_bytes"]
    assert memory["training_muon"] == 16 * total - 4 * in_muon and memory["training_adamw"] == 16 * total
    table = runner.invoke(app, ["params", str(muon)]).stdout
    assert "training with Muon + AdamW" in table and "training with AdamW (16 B/param)" not in table
    table = runner.invoke(app, ["params", str(adamw)]).stdout
    assert "training with AdamW (16 B/param)" in table and "training with Muon" not in table


def test_the_recipe_records_the_warmup_the_run_used(runner, tmp_path: Path) -> None:
    """warmup 100 on a 20-step budget ramps over 2 steps (at most a tenth of the steps): the logged rates
    climb for 1 step and reach the peak at the 2nd; the card and `minigpt runs` say so; a warmup the
    budget leaves alone is shown as given."""
    out = _run(tmp_path, "capped", max_iters=20, warmup=100, log_every=1, eval_every=10)
    rates = [r["lr"] for r in RunDir(out).read_metrics() if r["kind"] == "train"]
    ramp = next(i for i, lr in enumerate(rates) if lr == max(rates))  # steps before the peak
    config = RunDir(out).read_config()
    assert config["metrics"]["warmup_steps"] == ramp + 1 == 2
    card = (out / "README.md").read_text()
    assert "warmup=2 (100 asked, capped by the budget)" in card
    listed = json.loads(runner.invoke(app, ["runs", str(tmp_path), "--json"]).stdout)
    assert "warmup=2 (100 asked, capped by the budget)" in listed[0]["settings"]
    plain = _run(tmp_path, "plain", max_iters=20, warmup=1)
    assert " warmup=1 " in (plain / "README.md").read_text()


def test_a_checkpoint_with_an_impossible_warmup_is_refused(tmp_path: Path) -> None:
    out = _run(tmp_path, "run", max_iters=2)
    from minigpt.common.files import load_tensors, save_tensors

    tensors, meta = load_tensors(out / RunDir.STATE)
    state = json.loads(meta["state"])
    save_tensors(out / RunDir.STATE, tensors, {**meta, "state": json.dumps({**state, "warmup_steps": -5})})
    with pytest.raises(MinigptError, match="impossible training state"):
        train(TrainConfig(max_iters=3), resume=out)
