"""The GPU bench scripts still run (CPU smoke mode), so a device call is never spent on a broken script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra",
    [
        # e2e.py with the caches on, then off (two variants, one transformers baseline): with the caches the first
        # rows take the uncached path, later ones hit the caches
        (
            "e2e.py",
            ["--variant", "caches:engine.image_cache=true,engine.prefix_cache=true", "--variant", "plain:"],
        ),
        ("vit.py", ["--fp8", "--rounds", "2"]),
        ("gpu_parity.py", []),
        ("gpu_parity.py", ["--fp8"]),
    ],
    ids=["e2e-caches", "vit-fp8", "gpu-parity", "gpu-parity-fp8"],
)
def test_bench_smoke(script, extra):
    data = [REPO / ".data", REPO.parent / "shared" / "data"]
    if (script == "e2e.py" or "--fp8" in extra) and not any((d / "tiger.jpeg").is_file() for d in data):
        pytest.skip(f"{script} {' '.join(extra)} needs tiger.jpeg and the ShareGPT sample (../shared/data)")
    # gpu_parity's and vit.py's compiled rows run eagerly here (TORCHDYNAMO_DISABLE): the CPU tests hold compiled =
    # eager already, and compiling their several models on a CPU takes minutes
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"} if script in ("gpu_parity.py", "vit.py") else None
    p = subprocess.run([sys.executable, str(REPO / "bench" / script), "--smoke", *extra], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    # the job ran through the runner; its rows' greedy tokens (8 rows x 4) equal transformers' on the tiny model
    if script == "e2e.py":
        assert "| batchvl caches run1 |" in p.stdout and "| batchvl plain run1 |" in p.stdout
        assert p.stdout.count("| transformers b=2 |") == 1
        for v in ("caches", "plain"):
            assert f"greedy tokens batchvl {v} run1 == transformers b=2: 32/32" in p.stdout
    if script == "vit.py" and "--fp8" in extra:
        assert "| ours-fp8 |" in p.stdout and "ours-fp8 vs ours-compiled (bf16) features" in p.stdout
    if script == "vit.py":
        assert "| ours-compiled |" in p.stdout and "| hf-sdpa-compiled |" in p.stdout
    if script == "gpu_parity.py" and "--fp8" in extra:  # FP8 vs bf16: every check ran, on seed job prompts
        assert "3 seed prompts" in p.stdout and "greedy first 32 tokens compiled FP8 == eager FP8" in p.stdout
        assert "| tiny-qwen2 (2 layers) | FP8 linear (_scaled_mm) vs its dequantized" in p.stdout
        assert "FAIL" not in p.stdout
    elif script == "gpu_parity.py":  # every check ran (the tiny model's numbers are not held)
        assert (
            "| tiny-qwen2 | decode attention op" in p.stdout and "greedy tokens default + caches" in p.stdout
        )
        assert "| tiny-qwen2 | cascade attention after a shared prefix (6 rows) bf16 vs fp32 |" in p.stdout
    if "--rounds" in extra:
        assert "median x floor" in p.stdout
    assert "|" in p.stdout  # the table
