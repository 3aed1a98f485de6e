"""Tokenizing a corpus into the store, on a thread beside training, and telling which chunks are ready.

Files are tokenized in a fixed order (validation files first, then the training files by content hash, a
shuffle that does not depend on names), each file's chunks in order. Under torchrun the processes of a
machine split the files between them (file i goes to local rank i mod local world size) and each sees
the others' chunks land in the shared store; a chunk is ready for everyone once its .json is there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from minigpt.corpus.encode import Encoder, Stopped, tokenize_file
from minigpt.corpus.inputs import Source
from minigpt.corpus.progress import Meter, Progress, text_size
from minigpt.corpus.readers import ReadOptions, ReadStats, documents
from minigpt.corpus.store import Chunk, Entry
from minigpt.errors import MinigptError
from minigpt.tokenizer import Tokenizer

POLL_SECONDS = 0.2  # how often a wait looks at the store for chunks other processes write


@dataclass(frozen=True)
class Share:
    """This process's part of the tokenizing: local rank `index` of `count` on its machine."""

    index: int = 0
    count: int = 1

    def owns(self, i: int) -> bool:
        return i % self.count == self.index


class Ingest:
    """The files of a corpus on their way into the store, and what of them is ready."""

    def __init__(
        self,
        sources: list[Source],
        entries: list[Entry],
        tokenizer: Tokenizer,
        opts: ReadOptions,
        progress: Progress,
        share: Share = Share(),
        threads: int = 1,
        roles: list[str] | None = None,
    ) -> None:
        self.sources, self.entries = sources, entries
        self.roles = roles or ["training"] * len(sources)
        self.tokenizer, self.opts, self.progress = tokenizer, opts, progress
        self.share, self.threads = share, threads
        self._chunks: list[list[Chunk]] = [[] for _ in sources]
        self._done = [False] * len(sources)
        self._reused = [False] * len(sources)  # found whole in the store
        self.stats = [ReadStats() for _ in sources]
        self.error: BaseException | None = None
        self.meter: Meter | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.complete_at_start = all(e.done() is not None for e in entries)

    # ------------------------------------------------------------------------------------------ worker

    def run(self, background: bool) -> None:
        """Tokenize this process's files: on a thread of its own when `background`, else here and now."""
        if not background:
            self._work(bar=True)
            if self.error is not None:
                raise self.error
            return
        self._thread = threading.Thread(
            target=self._work, args=(False,), daemon=True, name="minigpt-tokenize"
        )
        self._thread.start()

    def stop(self) -> None:
        """Ask the worker to stop after its current job and wait for it (finished chunks stay)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _work(self, bar: bool) -> None:
        mine = [i for i in range(len(self.sources)) if self.share.owns(i)]
        total = sum(self.sources[i].size for i in mine)
        try:
            with (
                self.progress.phase("tokenizing", total, bar=bar) as meter,
                ThreadPoolExecutor(self.threads) as pool,
            ):
                self.meter = meter
                encoder = Encoder(self.tokenizer)
                for i in mine:
                    self._one(i, encoder, pool, meter)
            self._report(mine, meter)
        except Stopped:
            if self.meter is not None:
                self.progress.note(
                    f"tokenizing stopped with the run at {self.meter.status().split(': ', 1)[1]}; the "
                    f"finished chunks stay in the store and the next run goes on from there"
                )
        except BaseException as e:  # the consumer raises it on its own thread
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def _report(self, mine: list[int], meter: Meter) -> None:
        chunks = [c for i in mine for c in self._chunks[i]]
        tokens, text = sum(c.tokens for c in chunks), sum(c.text_bytes for c in chunks)
        fresh = sum(self.sources[i].size for i in mine if not self._reused[i])
        seconds = meter.clock() - meter.started
        what = f"{len(mine)} file(s), {text_size(text)} of text -> {tokens:,} tokens"
        if not fresh:
            self.progress.note(f"reusing the tokens of {what} from the store ({self.entries[0].dir.parent})")
        else:
            self.progress.note(
                f"tokenized {what} in {seconds:.1f}s ({fresh / 1e6 / max(seconds, 1e-9):.1f} MB/s)"
            )

    def _one(self, i: int, encoder: Encoder, pool: ThreadPoolExecutor, meter: Meter) -> None:
        src, entry, stats = self.sources[i], self.entries[i], self.stats[i]
        done = entry.done()
        if done is not None:
            # checksums and id ranges on every thread (zlib and NumPy release the GIL)
            chunks = list(pool.map(lambda k: entry.chunk(k, verify=True), range(done["chunks"])))
            if any(c is None for c in chunks):
                self.progress.note(
                    f"the stored tokens of {src.path} ({entry.dir}) fail their check (damaged, incomplete or "
                    f"from an older minigpt): tokenizing again"
                )
            else:
                for k, c in enumerate(chunks):
                    self._publish(i, k, c)
                stats.skipped, stats.first_skipped = done["skipped"], str(done.get("first_skipped", ""))
                stats.documents = done["documents"]
                meter(src.size)
                self._reused[i] = True
                self._finish(i)
                return
        pieces = documents(src, self.opts, meter, stats)
        where = f"{self.roles[i]} file {src.path}"
        chunks = tokenize_file(
            pieces, entry, encoder, pool, self.threads, lambda k, c: self._publish(i, k, c), self._stop, where
        )
        entry.finish(chunks, stats.skipped, stats.first_skipped)
        self._finish(i)

    def _publish(self, i: int, k: int, chunk: Chunk) -> None:
        with self._cond:
            if k == len(self._chunks[i]):
                self._chunks[i].append(chunk)
            self._cond.notify_all()

    def _finish(self, i: int) -> None:
        stats = self.stats[i]
        if stats.skipped:
            self.progress.note(
                f"skipped {stats.skipped:,} bad record(s) in {self.sources[i].path} "
                f"(the first: {stats.first_skipped})"
            )
        with self._cond:
            self._done[i] = True
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------ readers

    def chunk(self, i: int, k: int) -> Chunk | None | bool:
        """Chunk k of file i if ready; False if the file is done with fewer chunks; None if not yet known."""
        self.raise_error()
        with self._cond:
            if k < len(self._chunks[i]):
                return self._chunks[i][k]
            if self._done[i]:
                return False
        if self.share.owns(i):
            return None
        return self._scan(i, k)

    def _scan(self, i: int, k: int) -> Chunk | None | bool:
        """Another process's file: what its store entry shows (whole chunks only)."""
        entry = self.entries[i]
        while (found := entry.chunk(len(self._chunks[i]), verify=False)) is not None:
            self._chunks[i].append(found)
        if k < len(self._chunks[i]):
            return self._chunks[i][k]
        done = entry.done()
        if done is not None and done["chunks"] == len(self._chunks[i]):
            self._done[i] = True
            return False
        return None

    def wait_chunk(self, i: int, k: int) -> Chunk | None:
        """Chunk k of file i, waiting for it to be tokenized; None when the file has fewer chunks."""
        while (answer := self.chunk(i, k)) is None:
            worker = self._thread
            if self.share.owns(i) and (worker is None or not worker.is_alive()):
                self.raise_error()
                raise MinigptError(f"tokenizing stopped before {self.sources[i].path} was done")
            with self._cond:
                self._cond.wait(POLL_SECONDS)
        return answer if isinstance(answer, Chunk) else None

    def raise_error(self) -> None:
        """Re-raise on the caller's thread what stopped the worker (a bad record, a full disk)."""
        if self.error is not None:
            if isinstance(self.error, OSError):
                where = self.error.filename or "the token store"
                raise MinigptError(f"cannot write {where}: {self.error.strerror or self.error}") from None
            raise self.error

    def walk(self, first: int, last: int) -> Iterator[tuple[int, int, Chunk]]:
        """(file, chunk index, chunk) of files first..last-1 in order, waiting for each."""
        for i in range(first, last):
            k = 0
            while (c := self.wait_chunk(i, k)) is not None:
                yield i, k, c
                k += 1

    def status(self) -> str | None:
        """How much of the corpus is tokenized, in words; None once all of it is."""
        if all(self._done) or self.meter is None:
            return None
        return self.meter.status()

    def done_all(self) -> bool:
        return all(self._done)

    def totals(self) -> tuple[int, int]:
        """Tokens and text bytes of the chunks known so far (all of them once every file is done)."""
        chunks = [c for chunks in self._chunks for c in chunks]
        return sum(c.tokens for c in chunks), sum(c.text_bytes for c in chunks)
