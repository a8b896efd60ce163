"""The flow: source rows -> preprocess workers -> admission (`scheduler`) -> the engine's sequences in flight ->
Parquet writer.

Every row carries its own clock (perf_counter, shared by the processes of one host); errors travel as rows.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from batchvl.data import SourceRow
from batchvl.llm.sampling import row_seed
from batchvl.preprocess import Prepared, PreprocessError
from batchvl.scheduler import longest_first, next_batch

if TYPE_CHECKING:  # the engine pulls in the model code: preprocess workers never import it
    from tqdm import tqdm

    from batchvl.engine import Sampling
    from batchvl.output import PartWriter

log = logging.getLogger(__name__)
# test hook: os._exit(17) once this many rows were handed to the writer (a crash mid-job)
EXIT_AFTER_ENV = "BATCHVL_EXIT_AFTER_ROWS"
# test hook: "N:SIGNAME[:RANK]", the process (of that torchrun rank) sends itself that signal once N rows were handed
# to the writer
SIGNAL_AFTER_ENV = "BATCHVL_SIGNAL_AFTER_ROWS"


class Stopped(Exception):
    """The job was asked to stop (SIGINT / SIGTERM) while waiting for a row."""


@dataclass
class Item:
    """A row on its way through the pipeline, with its clock."""

    row: SourceRow
    t_read: float
    t_start: float | None = None  # preprocessing began
    t_prepared: float | None = None
    prepared: Prepared | None = None
    error: str | None = None
    request: Any = None  # the engine's Request, built when the row is ready
    batch_id: int | None = None  # the prefill batch that admitted it
    t_batch: float | None = None
    wait_ms: float | None = None  # how long the engine sat idle before that batch


# ---------------------------------------------------------------- preprocessing

_WORKER_PRE: Callable | None = None


def die_with_parent(parent: int) -> None:
    """This process is killed when `parent` dies, even by SIGKILL (Linux), and exits now if it already has."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _init_worker(pre: Callable, parent: int) -> None:
    """Pool initializer: die with the parent (even on its SIGKILL), ignore Ctrl-C (the parent decides what stops),
    keep this worker's Preprocessor (its tokenizer loads once, on first use)."""
    global _WORKER_PRE
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    _WORKER_PRE = pre


def _warm() -> None:
    """Load the worker's tokenizer before the first row arrives."""
    _WORKER_PRE("warm up", None)


def prepare_one(
    pre: Callable, prompt: Any, image: Any, cached: Collection[str] = ()
) -> tuple[Prepared | None, str | None, float, float]:
    """(prepared, error, t_start, t_end); pixel_values (raw uint8 tiles) travel as numpy between processes.
    cached: image keys the engine holds features for (their rows' tiles are not sent)."""
    t0 = time.perf_counter()
    try:
        out, err = pre(prompt, image, cached), None
    except PreprocessError as e:
        out, err = None, str(e)
    except Exception as e:  # a bug or an unexpected decoder failure: still only this row fails
        out, err = None, f"preprocess: {type(e).__name__}: {e}"
    return out, err, t0, time.perf_counter()


def _prepare_in_worker(
    prompt: Any, image: Any, cached: Collection[str] = ()
) -> tuple[Prepared | None, str | None, float, float]:
    out, err, t0, t1 = prepare_one(_WORKER_PRE, prompt, image, cached)
    if out is not None and isinstance(out.pixel_values, torch.Tensor):
        out.pixel_values = out.pixel_values.numpy()
    return out, err, t0, t1


def _pinned(fut: Future) -> tuple:
    """In a helper thread: wait for a worker's result and page-lock its (uint8) tiles, so the engine's host-to-device
    copy is asynchronous and no main-thread time goes to it; the engine normalizes them on its device."""
    res = fut.result()
    out = res[0]
    if out is not None and out.pixel_values is not None and not isinstance(out.pixel_values, torch.Tensor):
        out.pixel_values = torch.from_numpy(out.pixel_values).pin_memory()
    return res


class Preparer:
    """Prepares rows in the order given: a spawn process pool with bounded in-flight work, or in-process (workers=0).
    pin: page-lock the tiles of finished rows in a helper thread (for a CUDA engine). row_timeout_s: a row that
    takes a worker longer fails, and the workers are replaced (in-process, with workers=0, nothing can stop it)."""

    def __init__(
        self,
        pre: Callable,
        workers: int,
        max_in_flight: int,
        pin: bool = False,
        row_timeout_s: float | None = None,
    ) -> None:
        self.pre, self.workers, self.max_in_flight = pre, workers, max(1, max_in_flight)
        self.row_timeout_s = row_timeout_s
        self.queue: deque[tuple[Item, Future | None]] = deque()
        self.pool: ProcessPoolExecutor | None = None
        self.pinner = ThreadPoolExecutor(1, thread_name_prefix="pin") if pin and workers else None
        self.head_clock: tuple[Item, float] | None = None  # the oldest row in flight, since when it is that
        if workers:
            self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that holds CUDA or process groups
        self.pool = ProcessPoolExecutor(
            self.workers, ctx, initializer=_init_worker, initargs=(self.pre, os.getpid())
        )
        self.warming = [self.pool.submit(_warm) for _ in range(self.workers)]

    def _kill(self, wait: bool = False) -> None:
        """Kill the workers at once (their rows in flight fail with BrokenProcessPool); `wait`: until reaped."""
        for proc in list((getattr(self.pool, "_processes", None) or {}).values()):
            proc.kill()
        self.pool.shutdown(wait=wait, cancel_futures=True)

    def wait_warm(self) -> None:
        """Block until the workers have started and loaded their tokenizers (before the job clock starts)."""
        if self.pool is not None:
            concurrent.futures.wait(self.warming)

    def head_ready(self) -> bool:
        """Whether `pop` would return at once."""
        return bool(self.queue) and (self.queue[0][1] is None or self.queue[0][1].done() or self._overdue())

    def has_room(self) -> bool:
        return len(self.queue) < (self.max_in_flight if self.pool else 1)

    def __len__(self) -> int:
        return len(self.queue)

    def submit(self, item: Item, cached: Collection[str] = ()) -> None:
        """Prepare `item`'s row; `cached`: image keys whose tiles need not come back (the engine holds their
        features)."""
        if self.pool is None:
            self._finish(item, prepare_one(self.pre, item.row.prompt, item.row.image, cached))
            self.queue.append((item, None))
        else:
            fut = self.pool.submit(_prepare_in_worker, item.row.prompt, item.row.image, cached)
            self.queue.append((item, self.pinner.submit(_pinned, fut) if self.pinner else fut))

    def put_done(self, item: Item) -> None:
        """Queue an item that needs no preparation (it already carries its error)."""
        self.queue.append((item, None))

    def pop(self, stop: threading.Event | None = None) -> Item:
        """The oldest row, prepared (or with its error); waits for it, raising Stopped when `stop` is set."""
        item, fut = self.queue[0]
        while fut is not None and not fut.done():
            if stop is not None and stop.is_set():
                raise Stopped
            if self._overdue():
                self.queue.popleft()
                self._fail_overdue(item)
                return item
            concurrent.futures.wait([fut], timeout=0.1)  # returns as soon as the row is ready
        self.queue.popleft()
        if fut is None:
            return item
        try:
            self._finish(item, fut.result())
        except BrokenProcessPool:
            self._recover(item)
        return item

    def _overdue(self) -> bool:
        """Whether the oldest row in flight has been in a worker for longer than row_timeout_s. Its clock starts
        when it became the oldest with every worker warm: workers take rows in order, so from then on one has it
        (it may have started earlier: a row is never cut short, it may get longer)."""
        if self.row_timeout_s is None or self.pool is None or not self.queue or self.queue[0][1] is None:
            return False
        head, now = self.queue[0][0], time.perf_counter()
        if self.head_clock is None or self.head_clock[0] is not head:
            if not all(f.done() for f in self.warming):
                return False
            self.head_clock = (head, now)
        return now - self.head_clock[1] > self.row_timeout_s

    def _fail_overdue(self, item: Item) -> None:
        """The row's worker is stuck: the row fails and fresh workers take the rows behind it."""
        item.error = (f"preprocessing took longer than preprocess.row_timeout_s ({self.row_timeout_s:g} s); "
                      "its worker was killed and replaced")  # fmt: skip
        item.t_start, item.t_prepared = self.head_clock[1], time.perf_counter()
        log.warning("row %s: %s", item.row.id, item.error)
        self._restart()

    def _restart(self) -> None:
        """Kill the workers and start fresh ones, which take the rows in flight that had not finished."""
        self._kill()
        self._start()
        self._resubmit()

    def _resubmit(self) -> None:
        """Give the (new) pool every row in flight that has not finished."""
        rest = list(self.queue)
        self.queue.clear()
        for it, fut in rest:
            if fut is None or (fut.done() and not fut.cancelled() and fut.exception() is None):
                self.queue.append((it, fut))  # already finished, or needs no preparation
            else:
                self.submit(it)

    def _recover(self, item: Item) -> None:
        """A worker died: retry this row alone on fresh workers (within row_timeout_s), then resubmit the rows
        behind it."""
        log.warning("a preprocess worker died; restarting the pool, retrying row %s alone", item.row.id)
        self._kill()
        self._start()
        self.wait_warm()
        t0 = time.perf_counter()
        retry = self.pool.submit(_prepare_in_worker, item.row.prompt, item.row.image)
        try:
            self._finish(item, retry.result(timeout=self.row_timeout_s))
        except BrokenProcessPool:
            item.error, item.t_prepared = "preprocess worker died on this row", time.perf_counter()
            return self._restart()
        except concurrent.futures.TimeoutError:
            self.head_clock = (item, t0)
            return self._fail_overdue(item)  # (restarts the workers)
        self._resubmit()

    @staticmethod
    def _finish(item: Item, result: tuple) -> None:
        out, err, item.t_start, item.t_prepared = result
        if (
            out is not None
            and out.pixel_values is not None
            and not isinstance(out.pixel_values, torch.Tensor)
        ):
            out.pixel_values = torch.from_numpy(out.pixel_values)
        item.prepared, item.error = out, err

    def close(self) -> None:
        """Stop the workers: killed, not asked to finish (a graceful exit of each spawned interpreter took 1-2 s of the
        job's clock; the rows in flight, if any, are ones nobody will collect, and one may be stuck)."""
        if self.pool is not None:
            self._kill(wait=True)
            self.pool = None
        if self.pinner is not None:
            self.pinner.shutdown(wait=True, cancel_futures=True)
            self.pinner = None


# ---------------------------------------------------------------- rows


def _attempt(fn: Callable, *args: Any) -> tuple[Any, str | None]:
    """(fn(*args), None), or (None, why) when the engine failed. Only the message is kept: the traceback would
    keep the failed batch's tensors (KV cache, activations) alive through the one-by-one retries."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - only engine calls come here; writer errors stop the job
        return None, f"{type(e).__name__}: {e}"


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (b - a) * 1e3


def base_row(item: Item, t0: float) -> dict:
    """The columns every row has: id, token counts and preprocessing times."""
    p, rel = item.prepared, (lambda t: None if t is None else t - t0)
    row = {
        "id": item.row.id,
        "error": item.error,
        "t_read_s": rel(item.t_read),
        "t_prepared_s": rel(item.t_prepared),
        "queue_ms": _ms(item.t_read, item.t_start),
        "preprocess_ms": _ms(item.t_start, item.t_prepared),
    }
    if p is not None:
        row.update(
            prompt_token_ids=list(p.input_ids),
            num_tiles=p.num_tiles,
            num_image_tokens=p.num_image_tokens,
            num_text_tokens=p.num_text_tokens,
        )
    return row


def result_row(item: Item, t0: float, res: Any, text: str) -> dict:
    """A finished row: outputs, its own clock and its batch's stage times (`res`: the engine's `Finished`)."""
    out = [int(t) for t in res.output_ids]
    t_first, t_done = res.first_token_s - t0, res.done_s - t0
    return {
        **base_row(item, t0),
        "batch_id": item.batch_id,
        "output_token_ids": out,
        "output_text": text,
        "finish_reason": res.finish_reason,
        "cache_hit_image": bool(res.cache_hit_image),
        "cached_prefix_tokens": int(res.cached_prefix_tokens),
        "batch_wait_ms": _ms(item.t_prepared, item.t_batch),
        "vit_ms": res.vit_ms,
        "prefill_ms": res.prefill_ms,
        "decode_ms": res.decode_ms,
        "input_wait_ms": item.wait_ms,
        "ttft_ms": t_first * 1e3,
        "e2e_ms": t_done * 1e3,
        "tpot_ms": (t_done - t_first) * 1e3 / (len(out) - 1) if len(out) > 1 else None,
        "t_batch_start_s": item.t_batch - t0,
        "t_first_token_s": t_first,
        "t_done_s": t_done,
    }


# ---------------------------------------------------------------- the loop


def own_max_new_tokens(m: Any, cap: int) -> int:
    """A row's own max_new_tokens: an integer (or a float that is one) in 1..cap; ValueError (the row's error)."""
    if isinstance(m, float) and m.is_integer():
        m = int(m)
    if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= cap:
        raise ValueError(f"max_new_tokens: expected an integer in 1..{cap} "
                         f"(generation.max_new_tokens caps it), got {m!r}")  # fmt: skip
    return m


def row_max_new_tokens(row: SourceRow, cap: int) -> int:
    """The tokens `row` may generate: its own max_new_tokens, else (absent or bad: it fails at once) the job's."""
    m = (row.generation or {}).get("max_new_tokens")
    try:
        return cap if m is None else own_max_new_tokens(m, cap)
    except ValueError:
        return cap


@dataclass
class Flow:
    """What the loop needs: the engine, a prepare callable, a decode callable and the budgets."""

    engine: (
        Any  # `engine.Engine`: admit, step, abort, and what admission asks (free_rows, blocks_needed, ...)
    )
    preprocessor: Callable  # (prompt, image, cached image keys) -> Prepared, picklable when workers > 0
    decode: Callable[[list[int]], str]
    sampling: Sampling  # the job's; a row's own columns override max_new_tokens, temperature and stop

    max_prefill_tokens: int = 16384
    max_vit_tiles: int = 64
    workers: int = 0
    prefetch: int = 32
    token_id: Callable[[str], int | None] = lambda text: None  # a stop string -> its single token id
    # the ranks of a tensor-parallel group: admission must not depend on when each rank's rows got ready, so each
    # waits for a full `prefetch` of prepared rows (or the end of its rows)
    lockstep: bool = False


FIRST_ROWS = 4  # rows taken before the first admission (a constant: tensor-parallel ranks must take alike)


class RowLoop:
    """Drives rows, longest max_new_tokens first (`scheduler.longest_first`), through preprocessing, admission
    (`scheduler.next_batch`), the engine's sequences in flight and the writer; counts what it did. Each row is
    written as soon as it finishes."""

    def __init__(
        self,
        flow: Flow,
        write: Callable[[dict], None],
        t0: float,
        progress: tqdm | None = None,
        stop: threading.Event | None = None,  # set (by a signal): finish what is written, admit nothing more
    ) -> None:
        self.flow, self.write, self.t0, self.progress = flow, write, t0, progress
        self.stop = stop
        self.batch_id = 0
        self.last_busy = t0  # when the engine last finished work: from then on it waits for input
        self.counts = {
            "rows": 0,
            "errors": 0,
            "batches": 0,
            "input_tokens": 0,
            "output_tokens": 0,
            "skipped": 0,
        }
        self.exit_after = int(os.environ.get(EXIT_AFTER_ENV, 0))
        after, _, name = os.environ.get(SIGNAL_AFTER_ENV, "").partition(":")
        name, _, rank = name.partition(":")
        mine = after and rank in ("", os.environ.get("RANK", "0"))
        self.signal_after = (int(after), getattr(signal, name)) if mine else None
        self.outstanding: set[int] = set()  # source indexes taken from the preparer, not yet written
        self.deferred: deque[tuple[int, dict]] = deque()  # error rows waiting for the rows before them
        self.ready: deque[Item] = deque()  # prepared rows waiting for admission
        self.evicted = False  # images may have left the engine's image cache since `ready` was last checked
        self.admitted = False  # whether any admission has been tried
        self.prep: Preparer | None = None  # the current run's
        self.emitted: deque[dict] = deque()  # written rows not yet yielded by `rows`

    def run(
        self, rows: Iterable[SourceRow], done: set[str] = frozenset(), prep: Preparer | None = None
    ) -> dict:
        """Process `rows`, skipping ids in `done`; returns counts. `prep` may be started early (warm workers)."""
        for _ in self.rows(rows, done, prep):
            pass
        return self.counts

    def rows(
        self, rows: Iterable[SourceRow], done: set[str] = frozenset(), prep: Preparer | None = None
    ) -> Iterator[dict]:
        """`run` as a generator: yields each row right after it is written, between the loop's steps. Closing it
        early drops the sequences in flight (the engine is free for another loop) and stops the workers at once."""
        f, eng = self.flow, self.flow.engine
        if prep is None:  # (not `prep or ...`: an idle Preparer has len 0)
            prep = Preparer(f.preprocessor, f.workers, f.prefetch)
        self.prep = prep
        cap = f.sampling.max_new_tokens
        # blocks of twice the rows in flight: within ~2% of sorting the whole job in simulations (jobs of 1k-30k
        # rows, lengths 16..512, 512 rows in flight), and a job of up to 4x the rows in flight is sorted whole
        block = 2 * (eng.free_rows() + eng.active)
        source = longest_first(self._to_run(rows, done), lambda row: row_max_new_tokens(row, cap), cap, block)
        try:
            while True:
                if self.stop is not None and self.stop.is_set():
                    self._halt()
                    break
                try:
                    self._top_up(source, prep, wait=f.lockstep or (not eng.active and not self.ready))
                except Stopped:
                    continue
                if not self.ready and not eng.active and not len(prep):
                    break  # every row is done
                if (
                    self.evicted
                ):  # an admission may have evicted images that rows in `ready` were prepared without
                    self._resend_tiles()
                batch = (
                    next_batch(self.ready, eng, f.max_prefill_tokens, f.max_vit_tiles) if self.ready else []
                )
                if batch:
                    self._feed(source, prep)  # the workers prepare the next batch while this one prefills
                    self._admit(batch)
                elif eng.active:
                    self._step()
                else:  # an idle engine cannot take the first row: it never will
                    it = self.ready.popleft()
                    need, have = eng.blocks_needed(it.request), eng.pool.num_blocks - 1
                    self._fail(it, f"needs {need} KV blocks; the engine's whole pool has {have}")
                self._flush_errors()
                yield from self._written()
            self._flush_errors()
            yield from self._written()
        finally:
            if eng.active:  # closed early or failed: nothing stays in flight
                eng.abort()
            prep.close()

    def _to_run(self, rows: Iterable[SourceRow], done: set[str]) -> Iterator[SourceRow]:
        """`rows` less the ids in `done` (written by an earlier run), counted as skipped."""
        for row in rows:
            if row.id in done:
                self.counts["skipped"] += 1
                self._tick(0, 0)
            else:
                yield row

    def _written(self) -> Iterator[dict]:
        while self.emitted:
            yield self.emitted.popleft()

    def _halt(self) -> None:
        """Stop: drop the sequences in flight and the rows not yet admitted (they run again on resume), and write
        the error rows that no unwritten row comes before."""
        self.flow.engine.abort()
        self.ready.clear()
        self._flush_errors()
        self.counts["interrupted"] = True
        log.warning("stopped: %d rows written in this run; the rest run on resume", self.counts["rows"])

    def _top_up(self, source: Iterator[SourceRow], prep: Preparer, wait: bool) -> None:
        """Feed the preparer, and move prepared rows to `ready` (up to `prefetch` rows ready and in preparation
        together; FIRST_ROWS before the first admission) without waiting, or, with `wait` (the engine is idle),
        waiting for one (in lockstep: for all of them). Error rows are set aside until the rows before them are
        written."""
        most = self._most()
        while len(self.ready) < most:
            # error rows waiting behind the rows in the preparer: no new rows until those are written
            if len(self.deferred) < self.flow.prefetch:
                self._feed(source, prep)
            if not len(prep) or not (wait or prep.head_ready()):
                return
            item = prep.pop(self.stop)
            if item.error:
                self.deferred.append((item.row.index, self._error_row(item)))
                self._flush_errors()  # written now unless a row before it is still running (bounded memory)
                continue
            self.outstanding.add(item.row.index)
            try:
                item.request = self._request(item)
            except ValueError as e:
                self._fail(item, str(e))
                continue
            if self._lost_image(item):
                prep.submit(item)
                continue
            self.ready.append(item)
            wait = self.flow.lockstep

    def _most(self) -> int:
        """Rows ready and in preparation together: before the first admission the image cache is empty and every
        row taken brings its tiles, so few."""
        return self.flow.prefetch if self.admitted else min(self.flow.prefetch, FIRST_ROWS)

    def _feed(self, source: Iterator[SourceRow], prep: Preparer) -> None:
        """Hand the preparer rows from `source` while it and `ready` hold fewer than `_most()` together."""
        cached = self.flow.engine.cached_images()
        while prep.has_room() and len(self.ready) + len(prep) < self._most():
            row = next(source, None)
            if row is None:
                return
            if row.error:  # e.g. duplicate id: keeps its place in line behind the first occurrence
                prep.put_done(Item(row, time.perf_counter(), error=row.error))
            else:
                prep.submit(Item(row, time.perf_counter()), cached)

    def _lost_image(self, it: Item) -> bool:
        """Whether `it` was prepared without tiles (its images were in the engine's image cache) and needs them now:
        an admission evicted an image since."""
        r = it.request
        return r.pixel_values is None and bool(r.images) and self.flow.engine.needs_vit(r)

    def _resend_tiles(self) -> None:
        """Rows in `ready` that lost their image: prepared again, with their tiles, behind the rows in flight."""
        self.evicted = False
        for it in [it for it in self.ready if self._lost_image(it)]:
            self.ready.remove(it)
            self.prep.submit(it)

    def _request(self, it: Item) -> Any:
        from batchvl.engine import Request

        p = it.prepared
        ids = torch.tensor(p.input_ids, dtype=torch.int64)
        sampling = self._sampling(it.row.generation)
        seed = row_seed(sampling.seed, it.row.id)
        r = Request(ids, p.pixel_values, p.image_key, sampling, handle=it, images=p.images, seed=seed)
        self.flow.engine.check_positions(r)
        return r

    def _sampling(self, own: dict | None) -> Sampling:
        """The job's sampling with the row's own settings; ValueError (the row's error) for a bad value."""
        job = self.flow.sampling
        if not own:
            return job
        out = {}
        m = own.get("max_new_tokens")
        if m is not None:
            out["max_new_tokens"] = own_max_new_tokens(m, job.max_new_tokens)
        t = own.get("temperature")
        if t is not None:
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < float("inf"):
                raise ValueError(f"temperature: expected a number >= 0, got {t!r}")
            out["temperature"] = float(t)
        stop = own.get("stop")
        if stop is not None:
            out["stop_token_ids"] = job.stop_token_ids + tuple(self._stop_ids(stop))
        return replace(job, **out)

    def _stop_ids(self, stop: Any) -> list[int]:
        """A stop token id, a stop token's text, or a list of them -> token ids."""
        ids = []
        for x in stop if isinstance(stop, (list, tuple)) else [stop]:
            if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
                ids.append(x)
            elif isinstance(x, str) and self.flow.token_id(x) is not None:
                ids.append(self.flow.token_id(x))
            else:
                raise ValueError(f"stop: {x!r} is neither a token id nor the text of one token")
        return ids

    def _error_row(self, item: Item) -> dict:
        return base_row(item, self.t0) | {"t_done_s": time.perf_counter() - self.t0}

    def _flush_errors(self) -> None:
        """Write error rows once every row before them in the source that the loop has taken is written (so a
        resume never skips the first occurrence of an id because its duplicate's error row made it to disk first:
        `longest_first` never lets a duplicate go before its first occurrence)."""
        first_open = min(self.outstanding, default=None)
        while self.deferred and (first_open is None or self.deferred[0][0] < first_open):
            self._emit(self.deferred.popleft()[1])

    def _admit(self, batch: list[Item]) -> None:
        """Prefill a batch; on an exception retry its rows one at a time, then give up on failing ones."""
        t_batch = time.perf_counter()
        wait_ms = max(0.0, t_batch - self.last_busy) * 1e3
        self.evicted = self.admitted = (
            True  # the image cache changes only at admission (a failed one included)
        )
        finished, why = _attempt(self.flow.engine.admit, [it.request for it in batch])
        self.last_busy = time.perf_counter()
        log.debug("admitted %d rows in %.3f s (engine idle %.0f ms before; %d in flight)", len(batch),
                  self.last_busy - t_batch, wait_ms, self.flow.engine.active)  # fmt: skip
        if why is not None:
            if len(batch) == 1:
                return self._fail(batch[0], f"engine: {why}")
            log.warning("engine failed on a batch of %d rows (%s); retrying them one by one", len(batch), why)
            for it in batch:
                if self._lost_image(it):  # the failed admission evicted its image
                    self.prep.submit(it)
                else:
                    self._admit([it])
            return
        for it in batch:
            it.batch_id, it.t_batch, it.wait_ms = self.batch_id, t_batch, wait_ms
        self.batch_id += 1
        self.counts["batches"] += 1
        self._results(finished)

    def _step(self) -> None:
        """One decode step; if it fails, every sequence in flight fails with it."""
        t0 = time.perf_counter()
        finished, why = _attempt(self.flow.engine.step)
        self.last_busy = time.perf_counter()
        log.debug("decode step in %.3f s, %d rows done", self.last_busy - t0, len(finished or ()))
        if why is None:
            return self._results(finished)
        log.warning("a decode step failed (%s); its %d rows fail", why, self.flow.engine.active)
        for it in self.flow.engine.abort():
            self._fail(it, f"engine: {why}")

    def _results(self, finished: list) -> None:
        for res in finished:
            it = res.handle
            self.outstanding.discard(it.row.index)
            # as vLLM's text: without the stop token that ended it (output_token_ids keep it)
            ids = res.output_ids[:-1] if res.finish_reason == "stop" else res.output_ids
            self._emit(result_row(it, self.t0, res, self.flow.decode(ids)))

    def _fail(self, item: Item, why: str) -> None:
        log.warning("row %s failed: %s", item.row.id, why)
        item.error = why
        self.outstanding.discard(item.row.index)
        self._emit(self._error_row(item))

    def _emit(self, row: dict) -> None:
        self.write(row)
        self.emitted.append(row)
        c = self.counts
        c["rows"] += 1
        n_in = n_out = 0
        if row.get("error"):
            c["errors"] += 1
        else:
            n_in, n_out = len(row.get("prompt_token_ids") or ()), len(row.get("output_token_ids") or ())
            c["input_tokens"] += n_in
            c["output_tokens"] += n_out
        self._tick(n_in, n_out)
        if self.signal_after and c["rows"] == self.signal_after[0]:
            os.kill(os.getpid(), self.signal_after[1])
        if self.exit_after and c["rows"] >= self.exit_after:
            log.error("%s=%d reached: exiting without cleanup (test hook)", EXIT_AFTER_ENV, self.exit_after)
            os._exit(17)

    def _tick(self, n_in: int, n_out: int) -> None:
        if self.progress is None:
            return
        self.progress.update(1)
        dt = max(time.perf_counter() - self.t0, 1e-9)
        c = self.counts
        self.progress.set_postfix(
            in_tok_s=f"{c['input_tokens'] / dt:.0f}",
            out_tok_s=f"{c['output_tokens'] / dt:.1f}",
            errors=c["errors"],
            refresh=False,
        )


def write_rows(writer: PartWriter | None, run: int = 0) -> Callable[[dict], None]:
    """The writer's add, each row stamped with the output dir's `run` number, or a no-op for ranks that do not
    write (tensor-parallel followers)."""
    return (lambda row: writer.add(row | {"run": run})) if writer is not None else (lambda row: None)
