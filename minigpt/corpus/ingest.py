"""Tokenizing a corpus into the store, on a thread beside training, and telling which chunks are ready.

The corpus is a list of parts (files, or spans of files: minigpt.corpus.split), tokenized in a fixed order
(validation first, then training), each part's chunks in order. Under torchrun the processes of a machine
split the parts between them (part i goes to local rank i mod local world size) and each sees the others'
chunks land in the shared store; a chunk is ready for everyone once its .json is there. Once its parts are
tokenized, each file is hashed whole (sha256, recorded by its stamp for resumes to compare).

Nothing found in the store is taken on its word: an entry's done.json must match the chunk files its folder
holds (a listing) before any of them is checked, and they are checked a window of them at a time. A file
that changed since it was stamped (minigpt.corpus.inputs.changes, asked before each chunk lands and once
the file is read) has the tokens read from it discarded, and the run stops: its tokenizer and its
validation split were drawn from the file as it was, so reading it again would not make the run whole.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from minigpt.corpus.encode import Encoder, Stopped, tokenize_file
from minigpt.corpus.inputs import Source, changes, file_sha256
from minigpt.corpus.progress import Meter, Progress, text_size
from minigpt.corpus.readers import ReadOptions, ReadStats, blank_error, documents
from minigpt.corpus.split import Part
from minigpt.corpus.store import Chunk, Entry, FileHashes
from minigpt.errors import MinigptError
from minigpt.tokenizer.base import Tokenizer

POLL_SECONDS = 0.2  # how often a wait looks at the store for chunks other processes write


@dataclass(frozen=True)
class Share:
    """This process's part of the tokenizing: local rank `index` of `count` on its machine."""

    index: int = 0
    count: int = 1

    def owns(self, i: int) -> bool:
        return i % self.count == self.index


class Ingest:
    """The parts of a corpus on their way into the store, and what of them is ready."""

    def __init__(
        self,
        sources: list[Source],
        parts: list[Part],
        entries: list[Entry],
        tokenizer: Tokenizer,
        opts: ReadOptions,
        progress: Progress,
        share: Share = Share(),
        threads: int = 1,
        hashes: FileHashes | None = None,
    ) -> None:
        self.sources, self.parts, self.entries = sources, parts, entries
        self.tokenizer, self.opts, self.progress = tokenizer, opts, progress
        self.share, self.threads, self.hashes = share, threads, hashes
        self._chunks: list[list[Chunk]] = [[] for _ in parts]
        self._parts_of: dict[int, list[int]] = {}  # each file's parts, so finishing one is not a scan
        for j, part in enumerate(parts):
            self._parts_of.setdefault(part.source, []).append(j)
        self._done = [False] * len(parts)
        self._reused = [False] * len(parts)  # found whole in the store
        self.stats = [ReadStats() for _ in parts]
        self.error: BaseException | None = None
        self.meter: Meter | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.complete_at_start = all(e.done() is not None for e in entries)

    # ------------------------------------------------------------------------------------------ worker

    def run(self, background: bool) -> None:
        """Tokenize this process's parts: on a thread of its own when `background`, else here and now."""
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
        mine = [j for j in range(len(self.parts)) if self.share.owns(j)]
        total = sum(self._extent(j) for j in mine)
        try:
            with (
                self.progress.phase("tokenizing", total, bar=bar) as meter,
                ThreadPoolExecutor(self.threads) as pool,
            ):
                self.meter = meter
                encoder = Encoder(self.tokenizer)
                for j in mine:
                    self._one(j, encoder, pool, meter)
            self._report(mine, meter)
            self._hash_files(mine)
        except Stopped:
            # a stop once every part is tokenized (the files' hashes were being recorded) loses nothing
            if self.meter is not None and not all(self._done[j] for j in mine):
                self.progress.note(
                    f"tokenizing stopped with the run at {self.meter.status().split(': ', 1)[1]}; the "
                    f"finished chunks stay in the store and the next run goes on from there"
                )
        except BaseException as e:  # the consumer raises it on its own thread
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def _extent(self, j: int) -> int:
        """Bytes on disk that reading part j gets through (a span of a compressed or Parquet file: half)."""
        src, span = self.sources[self.parts[j].source], self.parts[j].span
        if span.whole:
            return src.size
        if src.compression is None and src.format != "parquet":
            return (src.size if span.stop is None else span.stop) - (span.start or 0)
        return src.size // 2

    def _report(self, mine: list[int], meter: Meter) -> None:
        chunks = [c for j in mine for c in self._chunks[j]]
        tokens, text = sum(c.tokens for c in chunks), sum(c.text_bytes for c in chunks)
        fresh = sum(self._extent(j) for j in mine if not self._reused[j])
        seconds = meter.clock() - meter.started
        files = len({self.parts[j].source for j in mine})
        what = f"{files} file(s), {text_size(text)} of text -> {tokens:,} tokens"
        if not fresh:
            self.progress.note(f"reusing the tokens of {what} from the store ({self.entries[0].dir.parent})")
        else:
            self.progress.note(
                f"tokenized {what} in {seconds:.1f}s ({fresh / 1e6 / max(seconds, 1e-9):.1f} MB/s)"
            )

    def _one(self, j: int, encoder: Encoder, pool: ThreadPoolExecutor, meter: Meter) -> None:
        part, entry, stats = self.parts[j], self.entries[j], self.stats[j]
        src = self.sources[part.source]
        done = entry.done()
        if done is not None:
            chunks = self._stored(entry, done, pool)
            if chunks is None:
                self.progress.note(
                    f"the stored tokens of {src.path} ({entry.dir}) fail their check (damaged, incomplete or "
                    f"from an older minigpt): tokenizing again"
                )
            else:
                for k, c in enumerate(chunks):
                    self._publish(j, k, c)
                stats.skipped, stats.first_skipped = done["skipped"], str(done.get("first_skipped", ""))
                stats.documents, stats.nonblank = done["documents"], done["nonblank"]
                meter(self._extent(j))
                self._reused[j] = True
                self._finish(j)
                return
        pieces = documents(src, self.opts, meter, stats, part.span)
        where = f"{part.role} file {src.path}"
        chunks = tokenize_file(
            pieces, entry, encoder, pool, self.threads, lambda k, c: self._publish(j, k, c), self._stop, where,
            unchanged=lambda: self._unchanged(src),
        )  # fmt: skip
        entry.finish(chunks, stats)
        self._finish(j)

    def _stored(self, entry: Entry, done: dict[str, Any], pool: ThreadPoolExecutor) -> list[Chunk] | None:
        """The entry's chunks if its folder holds what done.json says and each chunk passes its check
        (chunks not checked since they last changed are checked on every thread: zlib and NumPy release the
        GIL; the others cost a stat), else None."""
        if not entry.holds(done):
            return None
        chunks = []
        for chunk in windowed(
            pool, lambda k: entry.chunk(k, verify=True), range(done["chunks"]), 2 * self.threads
        ):
            if chunk is None:
                return None
            chunks.append(chunk)
        return chunks

    def _unchanged(self, src: Source) -> None:
        """Nothing, if the file is as it was stamped; else a warning and the error that stops the run."""
        how = changes(src)
        if how is None:
            return
        self.progress.note(
            f"warning: {src.path} changed while it was read ({how}); the tokens read from it since its last "
            f"check are discarded"
        )
        raise MinigptError(f"{src.path} changed while it was read; run again once nothing is writing to it")

    def _publish(self, j: int, k: int, chunk: Chunk) -> None:
        with self._cond:
            if k == len(self._chunks[j]):
                self._chunks[j].append(chunk)
            self._cond.notify_all()

    def _finish(self, j: int) -> None:
        stats, i = self.stats[j], self.parts[j].source
        if stats.skipped:
            self.progress.note(
                f"skipped {stats.skipped:,} bad record(s) in {self.sources[i].path} "
                f"(the first: {stats.first_skipped})"
            )
        with self._cond:
            self._done[j] = True
            self._cond.notify_all()
        siblings = self._parts_of[i]
        if all(self._done[n] for n in siblings) and not any(
            self.stats[n].nonblank or self.stats[n].skipped for n in siblings
        ):
            raise blank_error(self.sources[i], self.opts)

    def _hash_files(self, mine: list[int]) -> None:
        """The sha256 of each file this process tokenized, recorded by its stamp (once: a file's record
        stays while its stamp does)."""
        if self.hashes is None:
            return
        fresh = dict.fromkeys(self.parts[j].source for j in mine if not self._reused[j])
        for i in fresh:
            src = self.sources[i]
            if self.hashes.get(src.stamp) is None:
                sha256 = file_sha256(src.path, lambda n: self._check_stop())
                if changes(src) is None:  # else the hash is of other bytes than the stamp's
                    self.hashes.put(src.stamp, sha256)

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise Stopped

    # ------------------------------------------------------------------------------------------ readers

    def chunk(self, j: int, k: int) -> Chunk | None | bool:
        """Chunk k of part j if ready; False if the part is done with fewer chunks; None if not yet known."""
        self.raise_error()
        with self._cond:
            if k < len(self._chunks[j]):
                return self._chunks[j][k]
            if self._done[j]:
                return False
        if self.share.owns(j):
            return None
        return self._scan(j, k)

    def _scan(self, j: int, k: int) -> Chunk | None | bool:
        """Another process's part: what its store entry shows (whole chunks only)."""
        entry = self.entries[j]
        while (found := entry.chunk(len(self._chunks[j]), verify=False)) is not None:
            self._chunks[j].append(found)
        if k < len(self._chunks[j]):
            return self._chunks[j][k]
        done = entry.done()
        if done is not None and done["chunks"] == len(self._chunks[j]):
            self._done[j] = True
            return False
        return None

    def wait_chunk(self, j: int, k: int) -> Chunk | None:
        """Chunk k of part j, waiting for it to be tokenized; None when the part has fewer chunks."""
        while (answer := self.chunk(j, k)) is None:
            worker = self._thread
            if self.share.owns(j) and (worker is None or not worker.is_alive()):
                self.raise_error()
                src = self.sources[self.parts[j].source]
                raise MinigptError(f"tokenizing stopped before {src.path} was done")
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
        """(part, chunk index, chunk) of parts first..last-1 in order, waiting for each."""
        for j in range(first, last):
            k = 0
            while (c := self.wait_chunk(j, k)) is not None:
                yield j, k, c
                k += 1

    def status(self) -> str | None:
        """How much of the corpus is tokenized, in words; None once all of it is."""
        if all(self._done) or self.meter is None:
            return None
        return self.meter.status()

    def done_all(self) -> bool:
        return all(self._done)

    def totals(self) -> tuple[int, int]:
        """Tokens and text bytes of the chunks known so far (all of them once every part is done)."""
        chunks = [c for chunks in self._chunks for c in chunks]
        return sum(c.tokens for c in chunks), sum(c.text_bytes for c in chunks)


def windowed(
    pool: ThreadPoolExecutor, work: Callable[[int], Chunk | None], items: Iterable[int], window: int
) -> Iterator[Chunk | None]:
    """work(item) for each item, on the pool, in order, with at most `window` of them submitted and not yet
    taken: a count read from the store, however large, never becomes a list of futures."""
    pending: deque[Future[Chunk | None]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
