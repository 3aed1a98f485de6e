"""The NumPy engine's kernels compiled in the background: a load whose kernels numba's cache lacks decodes on
the array path at once, while another process compiles them into that cache for the loads after it (and
for this process's next generation: `NumpyEngine`'s `ready`).

numba compiles the kernels the first time they are called with each set of argument types
(`kernels.entries`), which took tens of seconds on two cores, silently, before the first token of a fresh
install's first `generate` (and `NumpyEngine` still does so where it is given no `plan`). Here the compile runs as `python -m minigpt.generate.engines.compiling QUANTIZE
KV_CACHE`, detached from the command (it outlives a short `generate`) and at a lower priority than it.
One process compiles at a time: it holds an exclusive lock on numba's cache folder (a second waits for it,
then finds compiled what the first compiled), which the kernel drops when it exits or is killed; loads ask
whether it is held with a shared lock let go at once (`held`). numba writes each compiled function to a temporary file renamed into place,
so an interrupted compile leaves what it finished and nothing half-written; the next load starts another
for the rest. A compile that fails leaves a record beside numba's cache naming the error: loads of the
same kernels and numba then say so in one line and decode on the array path without trying again.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from minigpt.common.files import atomic_write_json, read_json
from minigpt.errors import MinigptError
from minigpt.generate.engines import kernels

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock to share, so kernels compile in the foreground
    fcntl = None  # type: ignore[assignment]

__all__ = ["BACKGROUND", "Background", "compiling_lock", "held", "main", "plan"]

FAILED = "minigpt-kernels-failed.json"  # beside numba's cache: the error of the last compile that failed
LOG = "minigpt-kernels.log"  # beside numba's cache: what the compiling process printed
BACKGROUND = "compiling the CPU kernels in the background (once); decoding without them meanwhile"
_STARTS = 2  # compiles one process starts, at most: a second where another process compiled other kernels
_NICE = 10  # the compile's priority below the command's: the tokens a user waits for come first


class Running(Protocol):
    def poll(self) -> int | None: ...


def _package_root() -> str:
    """The folder the minigpt package was imported from: the compiling process imports the same source,
    whose path and time stamp numba's cache is keyed by."""
    return str(Path(__file__).parents[3])


def spawn(quantize: str, kv_cache: str, folder: Path) -> Running:
    """Start the compiling process, detached (its own session: a Ctrl-C of the command does not reach it),
    its output added to LOG."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "minigpt.generate.engines.compiling", quantize, kv_cache]
    with open(folder / LOG, "ab") as log:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip


def _identity(quantize: str, kv_cache: str) -> dict[str, Any]:
    """What a failure record holds to: these kernels' source, numba, Python and the argument types."""
    source = os.stat(kernels.__file__)
    return {
        "source": [source.st_mtime_ns, source.st_size],
        "numba": getattr(kernels.numba, "__version__", None),
        "python": sys.version,
        "quantize": quantize,
        "kv_cache": kv_cache,
    }


@contextlib.contextmanager
def compiling_lock(folder: Path) -> Iterator[None]:
    """Hold the exclusive lock on numba's cache folder, waiting for a process that holds it: a second
    compiling process then finds compiled what the first compiled."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # the lock goes with the descriptor


def held(folder: Path) -> bool:
    """Whether a process compiles into numba's cache `folder` (holds its exclusive lock). Asked with a shared
    lock, taken and let go at once: a compiling process that asks for its lock meanwhile waits for it
    rather than find it taken."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@dataclass
class Background:
    """One set of kernels (blocks' weights in `quantize` form, a `kv_cache` KV cache) and the process that
    compiles them into numba's cache `folder`. `lacking` lists what the cache lacks (`kernels.missing`);
    `start` starts a compile (`spawn`); `is_locked` says whether a process holds the folder's lock (`held`)."""

    quantize: str
    kv_cache: str
    folder: Path
    lacking: Callable[[], Sequence[object]]
    start: Callable[[], Running]
    is_locked: Callable[[], bool]
    started: list[Running] = field(default_factory=list)

    @classmethod
    def of(cls, quantize: str, kv_cache: str, folder: Path) -> Background:
        return cls(
            quantize, kv_cache, folder, lambda: kernels.missing(kernels.entries(quantize, kv_cache)),
            lambda: spawn(quantize, kv_cache, folder), lambda: held(folder),
        )  # fmt: skip

    def compiling(self) -> bool:
        """Whether a compile is under way: one this process started, or any holding the lock."""
        return any(p.poll() is None for p in self.started) or self.is_locked()

    def failure(self) -> str | None:
        """The error of a compile of these kernels that failed (with this source, numba and Python)."""
        with contextlib.suppress(OSError, ValueError, MinigptError):
            record = read_json(self.folder / FAILED)
            if isinstance(record, dict) and record.get("identity") == _identity(self.quantize, self.kv_cache):
                return str(record.get("error"))
        return None

    def begin(self) -> None:
        """Start a compile (`_STARTS` at most in a process)."""
        if len(self.started) < _STARTS:
            self.started.append(self.start())

    def ready(self) -> bool:
        """Whether numba's cache holds every kernel now, asked before each generation: no compile under way
        and none lacking. Where one is lacking with none under way (another process compiled other
        kernels, or was killed), a compile starts again."""
        if self.compiling():
            return False
        if not self.lacking():
            return True
        if self.failure() is None:
            self.begin()
        return False


def plan(
    quantize: str,
    kv_cache: str,
    notice: Callable[[str], None],
    background: Callable[[str, str, Path], Background] = Background.of,
) -> tuple[bool, Callable[[], bool] | None]:
    """Whether a NumPy engine about to load its kernels loads them now (its `plan`): numba's cache holds
    them: (True, None); they are lacking: (False, ready), the array path now and a compile in the
    background (said in one line on `notice`), `ready` saying when it is done; a compile of them failed
    before, or numba keeps no cache: (False, None), the array path, said in one line."""
    if fcntl is None:
        return True, None
    folder = kernels.cache_folder()
    if folder is None:
        if not kernels.caches():
            notice("numba has no folder it can write to keep compiled kernels in (set NUMBA_CACHE_DIR to "
                   "one): decoding without them")  # fmt: skip
            return False, None
        return True, None  # numba's cache internals have moved: load them as numba does
    bg = background(quantize, kv_cache, Path(folder))
    if not bg.lacking():
        return True, None
    error = bg.failure()
    if error is not None:
        notice(f"compiling the CPU kernels failed ({error}; {bg.folder / LOG}): decoding without them")
        return False, None
    if not bg.compiling():
        try:
            bg.begin()
        except OSError as e:
            notice(f"cannot start compiling the CPU kernels ({e.strerror or e}): decoding without them")
            return False, None
    notice(BACKGROUND)
    return False, bg.ready


def main(argv: Sequence[str]) -> int:
    """The compiling process: once no other holds the lock, compile what numba's cache lacks of the kernels
    for QUANTIZE and KV_CACHE, saying when it starts and how it ended (`done`, `failed`: the last line of
    LOG); a failure is recorded (FAILED)."""
    quantize, kv_cache = argv
    with contextlib.suppress(OSError):
        os.nice(_NICE)
    folder = kernels.cache_folder()
    if folder is None or fcntl is None:
        print("failed: numba keeps no cache here", flush=True)
        return 1
    print(
        f"compiling the kernels for weights {quantize}, KV cache {kv_cache} (process {os.getpid()})",
        flush=True,
    )
    started = time.monotonic()
    with compiling_lock(Path(folder)):
        wanted = kernels.missing(kernels.entries(quantize, kv_cache))
        try:
            kernels.compile_entries(wanted)
        except Exception as e:
            traceback.print_exc()
            lines = str(e).strip().splitlines()
            error = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
            record = {"identity": _identity(quantize, kv_cache), "error": error}
            atomic_write_json(Path(folder) / FAILED, record)
            print(f"failed: {error}", flush=True)
            return 1
    print(f"done: {len(wanted)} compiled in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
