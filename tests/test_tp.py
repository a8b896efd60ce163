"""LLM tensor parallelism over gloo (torchrun --nproc N on CPU) equals one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "dist" / "llm_tp_worker.py"


def _torchrun(n: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-port=0",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", str(WORKER), str(out)]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _torchrun(1, tmp_path_factory.mktemp("tp1") / "one.pt")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_llm_tp_equals_one_process(tmp_path, tp, one_process):
    one = one_process
    many = _torchrun(tp, tmp_path / f"tp{tp}.pt")
    torch.testing.assert_close(many["logits"], one["logits"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(many["last_logits"], one["last_logits"], atol=1e-5, rtol=1e-4)
    last = torch.tensor([5, 11, 3]).cumsum(0) - 1
    torch.testing.assert_close(one["last_logits"], one["logits"][last], atol=1e-5, rtol=1e-4)
    assert many["tokens"] == one["tokens"]
