"""Process groups for `world = replicas x tp` (torchrun's RANK/WORLD_SIZE/LOCAL_RANK) and small collective helpers.

Ranks r*tp .. r*tp+tp-1 form replica r (one tensor-parallel group). A gloo "control" group with a long timeout
carries barriers and object collectives, so a long tail on one replica never trips an NCCL watchdog.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

CONTROL_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1
    tp_group: Any = None  # this replica's ranks (None when tp == 1)
    dp_group: Any = None  # ranks with the same tp rank across replicas (None when single-process)
    control: Any = None  # gloo group over all ranks

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


def init(tp: int = 1, device_type: str = "cpu") -> DistContext:
    """Join the process group (nccl on GPU, gloo on CPU) when WORLD_SIZE > 1 and build the tp/dp groups."""
    rank, world, local = env_ranks()
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of model.tp={tp}")
    ctx = DistContext(rank, world, local, tp)
    if world == 1:
        return ctx
    if not tdist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local)
            tdist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            tdist.init_process_group("gloo")
    ctx.control = tdist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    for r in range(world // tp):  # every rank must create every group, in the same order
        g = tdist.new_group(list(range(r * tp, (r + 1) * tp))) if tp > 1 else None
        if r == ctx.replica:
            ctx.tp_group = g
    for t in range(tp):
        g = tdist.new_group(list(range(t, world, tp)))
        if t == ctx.tp_rank:
            ctx.dp_group = g
    return ctx


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        tdist.barrier(group=ctx.control)


def all_gather_object(ctx: DistContext, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    tdist.all_gather_object(out, obj, group=ctx.control)
    return out


def broadcast_object(ctx: DistContext, obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src, group=ctx.control)
    return box[0]


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and tdist.is_initialized():
        tdist.destroy_process_group()
