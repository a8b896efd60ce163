"""dist.Heartbeat on an in-memory store (no process group): its thread ends with the rank's run."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as tdist

from batchvl import dist


@pytest.fixture
def store(monkeypatch):
    s = tdist.HashStore()
    monkeypatch.setattr(tdist.distributed_c10d, "_get_default_store", lambda: s)
    return s


def _ctx() -> dist.DistContext:
    return dist.DistContext(rank=0, world_size=2, timeout=datetime.timedelta(seconds=1))


def _beats(store, beat: dist.Heartbeat) -> int:
    return int(store.get(f"{beat.key}0"))


def test_the_heartbeat_thread_is_gone_after_finish(store):
    beat = dist.Heartbeat(_ctx())
    time.sleep(3 * beat.every)
    assert beat.thread.is_alive() and _beats(store, beat) >= 2  # it beats while the rank runs
    store.set(f"{beat.key}done1", "1")  # rank 1 is done too
    beat.finish()
    assert not beat.thread.is_alive()
    n = _beats(store, beat)
    time.sleep(3 * beat.every)
    assert _beats(store, beat) == n


def test_finish_names_a_stalled_rank_and_ends_the_thread(store):
    beat = dist.Heartbeat(_ctx())
    with pytest.raises(dist.RankStalled, match=r"rank\(s\) 1 did not answer"):
        beat.finish()  # rank 1 never beats nor finishes
    assert not beat.thread.is_alive()


def test_stop_ends_the_thread_of_a_run_that_ended_without_finish(store):
    beat = dist.Heartbeat(_ctx())
    beat.stop()
    beat.stop()
    assert not beat.thread.is_alive()
