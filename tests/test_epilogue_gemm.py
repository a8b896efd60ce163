"""The ViT GEMMs with norms / residuals / GELU in their epilogues: the folded math against the eager modules (CPU
references), the Triton kernel through Triton's interpreter, and the encoder through them against the eager one."""

from __future__ import annotations

import textwrap

import pytest
import torch
from test_bench import _run_interpreted
from test_internvit import build_pair

from batchvl.encoder.epilogue_gemm import (
    fold_norm,
    gemm_residual,
    normed_linear,
    row_stats,
)
from batchvl.encoder.internvit import RMSNorm
from batchvl.encoder.internvit_compiled import compile_encoder, fast_forward_epilogue, fold_layers

ATOL, RTOL = 1e-5, 1e-4


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("gelu", [False, True])
def test_folded_norm_equals_norm_then_linear(rms, gelu) -> None:
    """gemm_normed (CPU reference) = linear(norm(x)) (then exact GELU) with the modules themselves, fp32; rows with
    a large mean (the LayerNorm's variance comes from sums of squares) and a linear with and without bias."""
    g = torch.Generator().manual_seed(0)
    K, N = 48, 40
    norm = RMSNorm(K, eps=1e-6) if rms else torch.nn.LayerNorm(K, eps=1e-6)
    lin = torch.nn.Linear(K, N, bias=not rms)
    with torch.no_grad():
        for p in [*norm.parameters(), *lin.parameters()]:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    x = torch.randn(9, K, generator=g) + 3 * torch.randn(9, 1, generator=g)
    with torch.no_grad():
        want = lin(norm(x))
        want = torch.nn.functional.gelu(want) if gelu else want
        got = normed_linear(x, row_stats(x), fold_norm(norm, lin), gelu)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_gemm_residual_and_its_stats() -> None:
    g = torch.Generator().manual_seed(1)
    a, w, x = (
        torch.randn(7, 32, generator=g),
        torch.randn(24, 32, generator=g),
        torch.randn(7, 24, generator=g),
    )
    b, ls = torch.randn(24, generator=g), torch.randn(24, generator=g)
    got, stats = gemm_residual(a, w, b, ls, x)
    want = x + ls * torch.nn.functional.linear(a, w, b)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(stats, row_stats(want), atol=1e-4, rtol=RTOL)


@pytest.mark.parametrize("vision", ["6b", "300m"])
def test_epilogue_forward_equals_eager(vision) -> None:
    """The encoder with every norm / residual / GELU folded into its GEMMs (eager, and compiled: each op traced as
    one node) = the eager encoder, fp32: 6B-style (RMSNorm, qk-norm, no qkv bias), 300M-style (LayerNorm, bias)."""
    enc, _ = build_pair(vision)
    with torch.no_grad():  # norms away from 1 and 0 biases, so folding them is tested
        for layer in enc.vit.layers:
            for p in [*layer.norm1.parameters(), *layer.norm2.parameters()]:
                p.copy_(1 + 0.3 * torch.randn_like(p)) if p.ndim else None
    px = torch.randn(3, 3, 112, 112)
    with torch.no_grad():
        ref = enc(px)
        got = fast_forward_epilogue(enc, px, fold_layers(enc))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    got = compile_encoder(enc, buckets=[4], epilogue_gemm=True)(px)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_epilogue_kernel_in_the_interpreter() -> None:
    """The Triton kernel (TRITON_INTERPRET=1 runs it on CPU tensors) against the references: fp32 tightly, fp16
    within its rounding; M and N not multiples of the tiles, fewer programs than tiles, both norms, GELU."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.encoder import epilogue_gemm as eg
        assert eg._use_triton(torch.zeros(1))  # the interpreter path, not the CPU fallback
        eg.CONFIGS[0] = (32, 16, 32, 2, 1, 4)  # small tiles: several per program and ragged edges
        torch.manual_seed(0)
        rel = lambda g, r: float((g.float() - r.float()).norm() / r.float().norm())
        for dt, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
            M, K, N = 70, 64, 48
            a, w, x = torch.randn(M, K), 0.1 * torch.randn(N, K), torch.randn(M, N)
            b, ls = torch.randn(N), torch.rand(N)
            got, st = eg.gemm_residual(*(t.to(dt) for t in (a, w, b, ls, x)))
            want, wst = eg.gemm_residual_reference(*(t.to(dt).float() for t in (a, w, b, ls, x)))
            assert got.dtype == dt and rel(got, want) < tol and rel(st, wst) < tol, (dt, rel(got, want))
            xs = torch.randn(M, K) + 2 * torch.randn(M, 1)
            stats = eg.row_stats(xs.to(dt))
            for rms in (False, True):
                for gelu in (False, True):
                    w_f, cs, bf = 0.1 * torch.randn(N, K), torch.randn(N), torch.randn(N)
                    args = (stats, w_f.to(dt), cs, bf, 1e-6, rms, gelu)
                    got = eg.gemm_normed(xs.to(dt), *args)
                    want = eg.gemm_normed_reference(xs.to(dt).float(), stats, w_f.to(dt).float(), cs, bf,
                                                    1e-6, rms, gelu)
                    assert got.shape == (M, N) and rel(got, want) < tol, (dt, rms, gelu, rel(got, want))
        print("ok")
        """
    )
    _run_interpreted(code)
