"""The GPU bench scripts still run (CPU smoke mode), so a device call is never spent on a broken script."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra",
    [
        ("e2e.py", []),
        ("e2e.py", ["--modes", "nocache,nocache+fp8,nocache+prefetch"]),
        ("vit.py", ["--fp8", "--unfused-norm", "--inplace-residual", "--sdpa-attn", "--rounds", "2"]),
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
    if "--inplace-residual" in extra:
        assert "| ours-inplace-residual |" in p.stdout and "| ours-not-inplace |" in p.stdout
    if "--sdpa-attn" in extra:
        assert "| ours-sdpa-attn |" in p.stdout
    if "--rounds" in extra:
        assert "median x floor" in p.stdout
    assert "|" in p.stdout  # the table


def _run_interpreted(code: str) -> None:
    """Run `code` in a fresh Python with TRITON_INTERPRET=1 (Triton kernels on the CPU); it must print "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


def test_probe_swiglu_kernel_in_the_interpreter():
    """The gate/up + SiLU * up Triton kernel `probe.py swiglu` times (TRITON_INTERPRET=1 runs it on CPU): equal to
    the eager MLP's sums, fp32 tightly and fp16 within fp16's rounding, with M and N not multiples of the tiles."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, "bench")
        from probe import swiglu_reference, swiglu_triton
        torch.manual_seed(0)
        for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            x, w = torch.randn(70, 128).to(dt), (0.1 * torch.randn(2 * 40, 128)).to(dt)
            got = swiglu_triton(x, w, (32, 32, 64, 4, 1, 4)).float()
            ref = swiglu_reference(x.float(), w.float())
            err = float((got - ref).norm() / ref.norm())
            assert got.shape == (70, 40) and err < tol, (dt, err)
        print("ok")
        """
    )
    _run_interpreted(code)


def test_probe_cls_split_equals_plain_attention():
    """`probe.py cls` times the ViT attention with the CLS key merged in by its log-sum-exp and the CLS query apart:
    on CPU (fp32, the CPU flash kernel's lse) it equals plain SDPA over all 1 + N tokens."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    try:
        from probe import mix_cls_split, mix_plain
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    B, T, H, D = 2, 1 + 16, 3, 8
    q, k, v = torch.randn(B, T, 3, H, D).unbind(2)  # [B, T, H, D] views, as in the encoder
    k = k * 3  # a spread of scores, so the CLS key's weight is far from uniform
    want = mix_plain(q, k, v, D**-0.5)
    got = mix_cls_split(q, k, v, D**-0.5, "cudnn")
    assert got.shape == want.shape == (B, T, H * D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_probe_tma_gemm_in_the_interpreter():
    """The persistent TMA GEMM `probe.py tma` times (TRITON_INTERPRET=1 runs it on CPU): equal to the product, with
    its epilogue to resid + ls * (product + bias) (and that result's row sums and sums of squares), with its norm
    prologue to (a * rstd * nw) @ w^T, with a LayerNorm folded into w and the epilogue (and GELU) to the linear of the
    normed input; fp32 tightly and fp16 within fp16's rounding; M and N not multiples of the tiles, fewer programs
    than tiles (each walks several)."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, "bench")
        from probe import mm_tma
        torch.manual_seed(0)
        cfg = (32, 16, 32, 2, 1, 4)
        for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            a, w = torch.randn(70, 64).to(dt), (0.1 * torch.randn(48, 64)).to(dt)
            r, ls, b = torch.randn(70, 48).to(dt), torch.rand(48).to(dt), torch.randn(48).to(dt)
            prod = a.float() @ w.float().t()
            rstd, nw = torch.rand(70) + 0.5, torch.rand(64).to(dt) + 0.5
            normed = (a.float() * rstd[:, None] * nw.float()).to(dt).float() @ w.float().t()
            for got, ref in ((mm_tma(a, w, cfg, num_sms=3), prod),
                             (mm_tma(a, w, cfg, r, ls, b, num_sms=3), r.float() + ls.float() * (prod + b.float())),
                             (mm_tma(a, w, cfg, num_sms=3, rstd=rstd, nw=nw), normed)):
                err = float((got.float() - ref).norm() / ref.norm())
                assert got.shape == (70, 48) and err < tol, (dt, err)
            # the residual epilogue's row statistics, summed over the row's two N tiles
            st = torch.zeros(2, 70)
            got = mm_tma(a, w, cfg, r, ls, b, num_sms=3, stats=st).float()
            for s, want in ((st[0], got.sum(-1)), (st[1], got.pow(2).sum(-1))):
                assert float((s - want).norm() / want.norm()) < tol
            # a LayerNorm of a folded into w and the epilogue, then GELU (tanh form)
            nb = torch.randn(64).to(dt)
            af = a.float()
            mu, rs = af.mean(-1), torch.rsqrt(af.var(-1, unbiased=False) + 1e-6)
            h = torch.nn.functional.layer_norm(af, (64,), nw.float(), nb.float(), 1e-6).to(dt).float()
            wf = (w.float() * nw.float()).to(dt)
            folded = (rs, mu, wf.float().sum(-1), b.float() + w.float() @ nb.float())
            lin = h @ w.float().t() + b.float()
            for gelu, ref in ((False, lin), (True, torch.nn.functional.gelu(lin, approximate="tanh"))):
                got = mm_tma(a, wf, cfg, num_sms=3, folded=folded, gelu=gelu)
                err = float((got.float() - ref).norm() / ref.norm())
                assert got.shape == (70, 48) and err < tol, (dt, gelu, err)
        print("ok")
        """
    )
    _run_interpreted(code)
