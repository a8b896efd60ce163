"""Process groups for `world = replicas x tp` (torchrun's RANK/WORLD_SIZE/LOCAL_RANK) and small collective helpers.

Ranks r*tp .. r*tp+tp-1 form replica r (one tensor-parallel group). A gloo "control" group carries barriers and
object collectives. Every group times out after `dist.timeout_s`; a `Heartbeat` lets ranks that wait for the others'
rows (a long tail) tell a slow rank, which keeps answering, from a stalled or dead one.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class RankStalled(RuntimeError):
    """A rank did not answer within dist.timeout_s (stalled, dead or far behind)."""


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1
    tp_group: Any = None  # this replica's ranks (None when tp == 1)
    dp_group: Any = None  # ranks with the same tp rank across replicas (None when single-process)
    control: Any = None  # gloo group over all ranks
    timeout: datetime.timedelta = DEFAULT_TIMEOUT  # of every wait on another rank

    @property
    def replica(self) -> int:
        return self.rank // self.tp

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_writer(self) -> bool:
        """The one rank of each replica that writes its rows."""
        return self.tp_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_ranks() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without it."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def init(tp: int = 1, device_type: str = "cpu", timeout_s: float | None = None) -> DistContext:
    """Join the process group (nccl on GPU, gloo on CPU) when WORLD_SIZE > 1 and build the tp/dp groups; every
    collective of every group times out after `timeout_s` (default 30 min)."""
    rank, world, local = env_ranks()
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of model.tp={tp}")
    ctx = DistContext(rank, world, local, tp)
    if timeout_s is not None:
        ctx.timeout = datetime.timedelta(seconds=timeout_s)
    if world == 1:
        return ctx
    t = ctx.timeout
    if not tdist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local)
            tdist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=t)
        else:
            tdist.init_process_group("gloo", timeout=t)
    ctx.control = tdist.new_group(backend="gloo", timeout=t)
    for r in range(world // tp):  # every rank must create every group, in the same order
        g = tdist.new_group(list(range(r * tp, (r + 1) * tp)), timeout=t) if tp > 1 else None
        if r == ctx.replica:
            ctx.tp_group = g
    for i in range(tp):
        g = tdist.new_group(list(range(i, world, tp)), timeout=t)
        if i == ctx.tp_rank:
            ctx.dp_group = g
    return ctx


def _meet(ctx: DistContext, group: Any, what: str) -> None:
    """Wait until every rank is here; RankStalled naming the ranks that were not within ctx.timeout."""
    try:
        tdist.monitored_barrier(group=group, timeout=ctx.timeout, wait_all_ranks=True)
    except RuntimeError as e:
        raise _stalled(ctx, what, e) from None


def _stalled(ctx: DistContext, what: str, e: Exception) -> RankStalled:
    # rank 0 names the ranks that did not come; the others see only that rank 0 gave up
    found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
    return RankStalled(
        _stalled_message(ctx, f"rank(s) {found.group(1)}" if found else "another rank", what, e)
    )


def _stalled_message(ctx: DistContext, who: str, what: str, detail: Any) -> str:
    return (f"{who} did not answer {what} within dist.timeout_s ({ctx.timeout.total_seconds():g} s): stalled or "
            f"dead [{detail}]. Rows already written are kept: run the same command again to resume")  # fmt: skip


def barrier(ctx: DistContext, what: str = "at a barrier") -> None:
    if ctx.distributed:
        _meet(ctx, ctx.control, what)


def all_gather_object(ctx: DistContext, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (first a barrier that names a rank that does not come)."""
    if not ctx.distributed:
        return [obj]
    _meet(ctx, ctx.control, "at a gather")
    out: list[Any] = [None] * ctx.world_size
    try:
        tdist.all_gather_object(out, obj, group=ctx.control)
    except RuntimeError as e:
        raise _stalled(ctx, "at a gather", e) from None
    return out


def broadcast_object(ctx: DistContext, obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (first a barrier that names a rank that does not come)."""
    if not ctx.distributed:
        return obj
    _meet(ctx, ctx.control, "at a broadcast")
    box = [obj]
    try:
        tdist.broadcast_object_list(box, src=src, group=ctx.control)
    except RuntimeError as e:
        raise _stalled(ctx, "at a broadcast", e) from None
    return box[0]


class Heartbeat:
    """From its start until stop() or finish(), a thread on each rank bumps its counter in the process group's store
    every few seconds; finish() waits for every rank to finish its rows for as long as their counters move (a long
    tail is fine), and raises RankStalled naming the ranks whose counter stood still for ctx.timeout (stalled or
    dead). Store calls are short: no wait on another rank is left pending in a process that exits (a pending
    collective would hold it)."""

    started = 0  # Heartbeats so far in this process: every rank starts them in the same order, so keys agree

    def __init__(self, ctx: DistContext) -> None:
        self.ctx, self.every = ctx, min(ctx.timeout.total_seconds() / 4, 10.0)
        Heartbeat.started += 1
        self.key = f"batchvl/heartbeat{Heartbeat.started}/"
        # the store torch.distributed rendezvoused through (no public accessor)
        self.store = tdist.distributed_c10d._get_default_store() if ctx.distributed else None
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        if self.store is not None:
            self.thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
            self.thread.start()

    def _beat(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self.store.set(f"{self.key}{self.ctx.rank}", str(n))
            except RuntimeError:  # the store is gone: the job is over
                return
            self._stop.wait(self.every)

    def stop(self) -> None:
        """End the beating thread (this rank's run is over, or it failed); safe to call more than once."""
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)  # a store call in flight is short unless the store's host is gone

    def finish(self) -> None:
        """This rank's rows are done: wait for every other rank's (RankStalled if one stopped answering)."""
        if self.store is None:
            return
        limit, seen = self.ctx.timeout.total_seconds(), {}
        try:
            self.store.set(f"{self.key}done{self.ctx.rank}", "1")
            while True:
                waiting = [
                    r for r in range(self.ctx.world_size) if not self.store.check([f"{self.key}done{r}"])
                ]
                if not waiting:
                    return
                now, stalled = time.monotonic(), []
                for r in waiting:
                    beat = self.store.get(f"{self.key}{r}") if self.store.check([f"{self.key}{r}"]) else b""
                    if r not in seen or seen[r][0] != beat:
                        seen[r] = (beat, now)
                    elif now - seen[r][1] > limit:
                        stalled.append(r)
                if stalled:
                    raise RankStalled(_stalled_message(self.ctx, f"rank(s) {', '.join(map(str, stalled))}",
                                                       "while the others waited for its rows", "no heartbeat"))  # fmt: skip
                time.sleep(min(self.every, 1.0))
        except RankStalled:
            raise
        except RuntimeError as e:  # the store's host is gone
            raise _stalled(self.ctx, "at the rendezvous store", e) from None
        finally:
            self.stop()


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and tdist.is_initialized():
        tdist.destroy_process_group()
