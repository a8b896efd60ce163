"""The GPU bench scripts still run (CPU smoke mode), so a device call is never spent on a broken script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra",
    [
        ("e2e.py", []),
        ("e2e.py", ["--modes", "nocache,nocache+fp8,nocache+prefetch"]),
        ("vit.py", ["--fp8", "--unfused-norm"]),
    ],
    ids=["e2e", "e2e-fp8", "vit-fp8"],
)
def test_bench_smoke(script, extra):
    data = [REPO / ".data", REPO.parent / "shared" / "data"]
    if script == "e2e.py" and not any((d / "tiger.jpeg").is_file() for d in data):
        pytest.skip("e2e needs tiger.jpeg and the ShareGPT sample (../shared/data)")
    p = subprocess.run([sys.executable, str(REPO / "bench" / script), "--smoke", *extra], cwd=REPO,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    # same greedy tokens as transformers on the tiny model, both engine modes
    if script == "e2e.py" and not extra:
        assert "greedy tokens batchvl nocache == transformers b=2: 16/16" in p.stdout
        assert "greedy tokens batchvl cache == transformers b=2: 16/16" in p.stdout
    # the FP8 ViT's downstream check ran (its count depends on the weights)
    if "nocache,nocache+fp8,nocache+prefetch" in extra:
        assert "greedy tokens batchvl nocache+fp8 == batchvl nocache:" in p.stdout
        assert "| batchvl nocache+prefetch |" in p.stdout
    if "--fp8" in extra:
        assert "| ours-fp8 |" in p.stdout and "ours-fp8 vs ours-compiled (bf16) features" in p.stdout
    if "--unfused-norm" in extra:
        assert "| ours-unfused-norm |" in p.stdout
    assert "|" in p.stdout  # the table
