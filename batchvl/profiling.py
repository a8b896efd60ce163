"""`BATCHVL_PROFILE_DIR=DIR`: torch.profiler over a job's rows (after the load and warm-up), as vLLM's
`VLLM_TORCH_PROFILER_DIR`. Each rank writes `DIR/<time>-rank<r>/`: `ops.txt`, the ops and kernels by their own device
time (CPU time on CPU), and `trace.json.gz`, the timeline for Perfetto or chrome://tracing. Off when unset: the
profiler slows the host side, so a profiled run's req/s is not the job's."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

PROFILE_ENV = "BATCHVL_PROFILE_DIR"
log = logging.getLogger("batchvl.profiling")


@contextmanager
def profiled(device: torch.device, rank: int = 0) -> Iterator[None]:
    """Profile the block when PROFILE_ENV is set."""
    root = os.environ.get(PROFILE_ENV)
    if not root:
        yield
        return
    out = Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        yield
    write_profile(prof, out, device)
    log.info("profile of the rows written to %s", out)


def write_profile(prof: profile, out: Path, device: torch.device) -> None:
    """`ops.txt` and `trace.json.gz` of a finished profile under `out`."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=80, max_name_column_width=90)
    (out / "ops.txt").write_text(table + "\n")
    prof.export_chrome_trace(str(out / "trace.json.gz"))  # torch gzips a .gz path
