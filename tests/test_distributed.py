"""Training under torchrun on the CPU (Gloo, 2 processes): same step as one process, resume, kills, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import typer
from conftest import ROOT, FakeClock

from minigpt.cli.main import app
from minigpt.common.files import load_tensors
from minigpt.data.dataset import BatchSampler, DataConfig
from minigpt.errors import MinigptError, UsageError
from minigpt.runs.folder import RunDir
from minigpt.train.distributed import DistContext, collective_timeout
from minigpt.train.loop import StopSignals, TrainConfig, TrainState, train
from minigpt.train.reporters import LineReporter
from minigpt.train.run import keep_global_batch

TEXT = "".join(
    f"{w} the quick brown fox jumps over the lazy dog {i % 7}.\n"
    for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 60)
)
TINY = ["--preset", "tiny", "--batch-size", "4", "--eval-iters", "2", "--log-every", "5", "--device", "cpu"]
RUN_FILES = sorted(RunDir.FILES)
linux_only = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds workers through /proc")


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def child_env() -> dict[str, str]:
    # one thread per worker on the 2-core machines; a collective stuck on a lost peer fails the test quickly
    return {**os.environ, "OMP_NUM_THREADS": "1", "MINIGPT_DIST_TIMEOUT": "30"}


def patient_env() -> dict[str, str]:
    """Collectives that would wait 20 minutes for a lost peer: a run that stops before the launcher's guard
    (Torchrun.finish) stopped because the loss or the signal was seen, however slow the machine is."""
    return {**child_env(), "MINIGPT_DIST_TIMEOUT": "1200"}


class Torchrun:
    """`torchrun ... -m minigpt ARGS` with its output read line by line as it comes (and copied to `log`),
    so a test waits for what the run reports, not on a timer. Each line it prints (a step, an evaluation)
    wakes `wait_for`."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, **kw: Any) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "minigpt", *map(str, args)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, **kw)  # fmt: skip
        self.log, self.ended = log, False
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._copy, daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "w") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                with self.changed:
                    self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def wait_for(self, done: Callable[[], bool], guard: float = 300) -> None:
        """Until `done()`, checked at each line of output; `guard` seconds only stop a hung test."""
        with self.changed:
            self.changed.wait_for(lambda: done() or self.ended, timeout=guard)
        if not done():
            self.proc.kill()
            pytest.fail(f"torchrun ended or stalled early:\n{self.log.read_text()[-3000:]}")

    def finish(self, guard: float = 240) -> str:
        """Wait for the launcher to exit (`guard`: a hang) and return everything it printed."""
        self.proc.wait(timeout=guard)
        self.reader.join()
        return self.log.read_text()


def records(run: Path, kind: str) -> list[dict]:
    return [r for r in RunDir(run).read_metrics() if r["kind"] == kind]


def worker_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if (
                not proc.name.isdigit()
                or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher
            ):
                continue
            env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(proc.name)
    return found


def gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def assert_loadable(run: Path) -> dict:
    model, _, _ = RunDir(run).load_model()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    tensors, meta = load_tensors(run / RunDir.STATE)
    assert any(k.startswith("optim/") for k in tensors)
    return json.loads(meta["state"])


class UnionSampler(BatchSampler):
    """One process drawing, per batch, exactly what ranks 0 and 1 of 2 draw with half the batch each."""

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__(tokens, block_size, batch_size, seed, rank, world_size)
        self.parts = [BatchSampler(tokens, block_size, batch_size // 2, seed, r, 2) for r in (0, 1)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(part.next_batch() for part in self.parts), strict=True)
        self.batches += 1
        return torch.cat(xs), torch.cat(ys)


@pytest.mark.slow
def test_two_processes_equal_one_with_the_same_global_batch_then_resume_on_one(
    text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`minigpt train --nproc 2` with batch 2 per rank takes the step that one process takes on batch 4 made
    of the same windows: loss, gradients (the AdamW first moments after one step are 0.1 x grad), weights and
    the cross-rank validation loss agree. The 2-process checkpoint then resumes in one process. (A 1-step budget
    caps warmup at that one step, so lr 8e-5 is the first step's.)"""
    two = tmp_path / "two"
    # a modern architecture: rotary, RMSNorm, QK-norm (with biases), ReLU², untied, one key/value head, a
    # local layer, the additive score (its chunks recomputed in the backward pass)
    opts = ["--preset", "tiny", "--eval-iters", "2", "--max-iters", "1", "--device", "cpu", "--dtype", "float32",
            "--seed", "7", "--dropout", "0", "--lr", "8e-5", "--arch", "modern", "--n-kv-head", "1",
            "--window", "8", "--qk-norm", "--bias", "--mlp", "relu2", "--attn-score", "additive"]  # fmt: skip
    cmd = [sys.executable, "-m", "minigpt", "train", str(text_file), *opts, "--batch-size", "2", "--out", str(two),
           "--nproc", "2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert proc.stderr.count("done: reached max_iters 1") == 1  # only rank 0 reports
    assert "cpu × 2 processes" in proc.stderr
    assert sorted(p.name for p in two.iterdir()) == RUN_FILES  # one writer, no stray temporary files
    assert [(r["kind"], r["step"]) for r in RunDir(two).read_metrics()] == [
        ("train", 1),
        ("eval", 1),
    ]

    cfg = TrainConfig(
        preset="tiny", eval_iters=2, max_iters=1, device="cpu", dtype="float32", seed=7, batch_size=4, lr=8e-5,
        arch="modern", overrides=dict(n_kv_head=1, window=8, qk_norm=True, bias=True, mlp="relu2",
                                      attn_score="additive"),
    )  # fmt: skip
    train(cfg, DataConfig(paths=(text_file,)), out=tmp_path / "one", make_sampler=UnionSampler)

    a, _ = load_tensors(two / RunDir.STATE)
    b, _ = load_tensors(tmp_path / "one" / RunDir.STATE)
    moments = [k for k in a if k.endswith("/exp_avg")]
    assert len(moments) > 5 and all(a[k].abs().max() > 0 for k in moments)
    for key in a:
        if key.endswith("/exp_avg"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-8, msg=key)
        elif key.endswith("/exp_avg_sq"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-12, msg=key)
        elif key.startswith("model/"):
            # Adam's first step moves each weight by about lr * g / (|g| + eps): where |g| is near eps a
            # rounding difference in the all-reduced gradient shifts it by a fraction of lr (8e-5 here)
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    ra, rb = RunDir(two).read_metrics(), RunDir(tmp_path / "one").read_metrics()
    assert ra[0]["tokens"] == rb[0]["tokens"] == 4 * 32
    assert ra[0]["loss"] == pytest.approx(rb[0]["loss"], rel=1e-5)
    for name in ("val_loss", "train_loss"):  # ranks score halves of the same windows; the mean is shared
        assert ra[1][name] == pytest.approx(rb[1][name], rel=1e-5)

    capsys.readouterr()
    resumed = train(TrainConfig(max_iters=3), resume=two, reporter=LineReporter())
    assert resumed.state.step == 3 and resumed.state.tokens == 3 * 4 * 32  # the global batch is kept
    assert "gradient accumulation 1 -> 2" in capsys.readouterr().err
    saved = json.loads((two / RunDir.CONFIG).read_text())["train"]
    assert (saved["batch_size"], saved["grad_accum"]) == (2, 2)
    assert assert_loadable(two)["world_size"] == 1


@pytest.mark.slow
def test_muon_under_two_processes_then_resume_on_one(text_file: Path, tmp_path: Path) -> None:
    """`--optimizer muon` under DDP: both optimizers are built on the bare model and step the all-reduced
    gradients; rank 0 saves Muon's momentum buffers (and NorMuon's row statistics), and the run resumes in
    one process with the same optimizer and model options."""
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "minigpt", "train", str(text_file), *TINY, "--max-iters", "2", "--optimizer",
           "muon", "--normuon", "--orthogonalizer", "polar-express", "--value-embeds", "--skips", "--logit-cap",
           "20", "--zero-init", "--batch-ramp", "0.5", "--seq-ramp", "0.5", "--out", str(two), "--nproc", "2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensors, _ = load_tensors(two / RunDir.STATE)
    buffers = [k for k in tensors if k.endswith(("/momentum_buffer", "/row_mean_square"))]
    # with --zero-init the head and the output projections start at 0: the first step moves only the head,
    # the second the output projections (whose inputs are not 0); the matrices before them wait a step more
    outputs = [k for k in buffers if ".c_proj." in k]
    assert len(buffers) >= 8 and outputs and all(tensors[k].abs().max() > 0 for k in outputs)
    resumed = train(TrainConfig(max_iters=3), resume=two)
    assert resumed.state.step == 3
    saved = json.loads((two / RunDir.CONFIG).read_text())
    assert (saved["train"]["optimizer"], saved["train"]["normuon"]) == ("muon", True)
    assert saved["train"]["overrides"]["value_embeds"] and saved["model"]["skips"]
    assert (saved["model"]["logit_cap"], saved["train"]["zero_init"], saved["train"]["batch_ramp"]) == (
        20,
        True,
        0.5,
    )
    assert saved["train"]["seq_ramp"] == 0.5


@pytest.mark.slow
@linux_only
def test_a_killed_rank_stops_the_launcher_and_leaves_a_loadable_checkpoint(
    text_file: Path, tmp_path: Path
) -> None:
    run, log = tmp_path / "run", tmp_path / "log.txt"
    launcher = Torchrun(
        ["train", text_file, *TINY, "--max-iters", "100000", "--eval-every", "5", "--out", run], log,
        env=patient_env(),
    )  # fmt: skip
    launcher.wait_for(lambda: len(records(run, "eval")) >= 2)
    ranks = worker_pids(launcher.proc.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[0], signal.SIGKILL)  # the rank that writes the checkpoints
    out = launcher.finish()  # ends well before the collectives' timeout: the loss was seen, not waited out
    assert launcher.proc.returncode != 0, out[-3000:]
    assert all(gone(pid) for pid in ranks.values())
    assert "rank 1 lost contact with the other training processes" in out  # one line, not a traceback
    state = assert_loadable(run)  # the last whole save: a save cut short by the kill leaves the one before
    assert state["step"] >= 5 and state["step"] % 5 == 0


@pytest.mark.slow
@linux_only
def test_ctrl_c_under_torchrun_stops_every_rank_after_saving_and_resume_changes_process_count(
    text_file: Path, tmp_path: Path
) -> None:
    """A 1-process run resumed by two processes (global batch kept), then Ctrl-C in the terminal: the launcher
    and both workers get SIGINT (the launcher relays it once more); the ranks stop together and save."""
    run, log = tmp_path / "run", tmp_path / "log.txt"
    cfg = TrainConfig(preset="tiny", batch_size=4, grad_accum=2, eval_iters=2, eval_every=3, log_every=5,
                      max_iters=3, device="cpu")  # fmt: skip
    train(cfg, DataConfig(paths=(text_file,)), out=run)
    launcher = Torchrun(
        ["train", "--resume", run, "--max-iters", "100000"], log, env=patient_env(), start_new_session=True
    )
    launcher.wait_for(lambda: any(r["step"] >= 10 for r in records(run, "train")))
    ranks = worker_pids(launcher.proc.pid)
    os.killpg(launcher.proc.pid, signal.SIGINT)
    out = launcher.finish()  # the ranks agree to stop at the next step, well before any timeout
    assert all(gone(pid) for pid in ranks.values())
    assert "gradient accumulation 2 -> 1" in out
    assert out.count("interrupted: stopped by SIGINT") == 1, out[-3000:]
    state = assert_loadable(run)
    last = records(run, "eval")[-1]
    assert state["step"] == last["step"] > 10  # saved at the step it stopped, not only at an eval_every
    assert state["tokens"] == state["step"] * 2 * 4 * 32 and state["world_size"] == 2


def test_relaunch_args_round_trip(runner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The workers get the command line `train --nproc` was given, minus --nproc: it parses to the same values."""
    monkeypatch.chdir(tmp_path)
    for name in ("a b.txt", "-x.txt"):
        Path(name).write_text(TEXT)
    seen = {}
    monkeypatch.setattr(
        "minigpt.train.distributed.launch_local", lambda n, args: seen.update(n=n, args=args) or 7
    )
    argv = ["train", "--preset", "tiny", "--no-bias", "--untie", "--n-kv-head", "1", "--compile", "--lr", "0.001",
            "--max-time", "5m", "--schedule", "wsd", "--optimizer", "muon", "--encoding-errors", "replace",
            "--out", "r", "--overwrite", "--nproc", "3", "--", "a b.txt", "-x.txt"]  # fmt: skip
    result = runner.invoke(app, argv)
    assert result.exit_code == 7, result.output
    assert seen["n"] == 3
    args = seen["args"]
    assert args[args.index("--") + 1 :] == ["a b.txt", "-x.txt"] and "--nproc" not in args
    assert {"--no-bias", "--untie", "--compile", "--overwrite"} <= set(
        args
    ) and "--allow-data-change" not in args
    train_command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    given = train_command.make_context("train", argv[1:]).params
    relaunched = train_command.make_context("train", list(args)).params
    assert relaunched == {**given, "nproc": None} and relaunched["max_time"] == 300.0


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda d: [str(d / "missing.txt")], "no such file"),
        (lambda d: [str(d / "t.txt"), "--batch-size", "0"], "batch_size"),
        (lambda d: [str(d / "t.txt"), "--out", str(d)], "already holds"),
        (lambda d: ["--resume", str(d / "nothing")], "nothing"),
    ],
)
def test_nproc_checks_before_launching(
    runner,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    make_args: Callable[[Path], list[str]],
    message: str,
) -> None:
    (tmp_path / "t.txt").write_text(TEXT)
    monkeypatch.setattr("minigpt.train.distributed.launch_local", lambda n, args: pytest.fail("launched"))
    result = runner.invoke(app, ["train", *make_args(tmp_path), "--nproc", "2"])
    assert result.exit_code in (1, 2)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output


def test_nproc_is_refused_inside_torchrun(runner, monkeypatch: pytest.MonkeyPatch, text_file: Path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = runner.invoke(app, ["train", str(text_file), "--nproc", "2"])
    assert result.exit_code == 2 and "drop it under torchrun" in result.output


def test_single_process_context_is_a_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    dist = DistContext.from_env("cpu")
    assert not dist.enabled and dist.is_master
    model = torch.nn.Linear(2, 2)
    assert dist.wrap(model, torch.device("cpu")) is model
    with dist.master_first(), dist.no_sync(model, last=False):
        pass
    t = torch.tensor([1.5, 2.0])
    assert dist.all_reduce_sum(t) is t and dist.all_reduce_mean(t) is t
    assert dist.agree_stop(True, 3.0, 0.5) == (True, [3.0, 0.5])
    with pytest.raises(RuntimeError, match="gloo"), dist.peer_errors(tmp_path):
        raise RuntimeError("gloo: only translated with several ranks")


def test_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIGPT_DIST_TIMEOUT", "45")
    assert collective_timeout().total_seconds() == 45
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("MINIGPT_DIST_TIMEOUT", bad)
        with pytest.raises(UsageError, match="MINIGPT_DIST_TIMEOUT"):
            collective_timeout()


def test_relayed_ctrl_c_is_one_request_but_a_later_one_exits() -> None:
    clock = FakeClock()
    stop = StopSignals(grace=0.5, clock=clock)
    with stop.installed():
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before the next line
        clock.now += 0.4
        os.kill(os.getpid(), signal.SIGINT)  # torchrun relaying the terminal's Ctrl-C
        assert stop.requested == "SIGINT"
        clock.now += 0.2  # 0.6 s after the first: a second Ctrl-C of the person at the terminal
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            signal.getsignal(signal.SIGINT)  # a line for the pending handler to run before


@pytest.mark.parametrize(
    "saved, world, accum, kept",
    [(2, 1, 1, 2), (1, 2, 2, 1), (4, 2, 1, 2), (2, 3, 1, 1), (2, 2, 3, 3)],
)
def test_resume_on_another_process_count_keeps_the_global_batch(
    saved: int, world: int, accum: int, kept: int
) -> None:
    class Log:
        lines: list[str] = []

        def log(self, text: str) -> None:
            self.lines.append(text)

    cfg = TrainConfig(batch_size=4, grad_accum=accum, max_iters=1)
    new = keep_global_batch(cfg, saved, world, Log())  # type: ignore[arg-type]
    assert new.grad_accum == kept
    if saved * accum % world:
        assert "warning" in Log.lines[-1]
    assert TrainState().world_size == 1  # checkpoints from before this field resume as 1-process runs


def test_errors_from_ranks_are_minigpt_errors() -> None:
    dist = DistContext(rank=1, world_size=2)
    with pytest.raises(MinigptError, match="rank 1 lost contact.*last checkpoint in run is intact"):
        with dist.peer_errors(Path("run")):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    with pytest.raises(RuntimeError, match="shape mismatch"), dist.peer_errors(Path("run")):
        raise RuntimeError("shape mismatch")


def test_nproc_relays_the_workers_lines_not_the_launchers_traceback(capsys: pytest.CaptureFixture) -> None:
    """Under `train --nproc`, a failed rank's one-line error reaches the user; torchrun's own log lines,
    traceback and failure report do not."""
    from types import SimpleNamespace

    from minigpt.train.distributed import _relay_worker_output

    launcher = [
        "step      5 | loss 5.6 | lr 4.00e-04\n",
        "error: rank 1 lost contact with the other training processes (...); the last checkpoint is intact\n",
        "W1122 17:51:38.409000 19269 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending\n",
        "Traceback (most recent call last):\n",
        '  File "<frozen runpy>", line 198, in _run_module_as_main\n',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
        "minigpt FAILED\n",
    ]
    proc = SimpleNamespace(stderr=iter(launcher))
    _relay_worker_output(proc)
    err = capsys.readouterr().err
    assert err.splitlines() == [launcher[0].rstrip(), launcher[1].rstrip()]
    assert proc.reported_error
