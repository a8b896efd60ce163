"""The compiled ViT's norm passes (`ops/fused_norm.py`): the Triton kernels through Triton's interpreter on CPU
against their references and the norm modules, the in-place residual forward against the eager encoder, and the one
builder's choice of ViT path."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch
from conftest import run_interpreted
from test_internvit import build_pair

from batchvl.encoder.internvit_compiled import CompiledEncoder, fast_forward_inplace, fold_scales
from batchvl.job import EngineSpec
from batchvl.model.build import vision_encoder
from batchvl.ops.fp8 import Fp8Linear

ATOL, RTOL = 1e-5, 1e-4


def randomize_scales(enc) -> None:
    """Layer scales and the proj / fc2 biases drawn away from 1 and 0, so folding them is tested."""
    with torch.no_grad():
        for layer in enc.vit.layers:
            for p in (layer.ls1, layer.ls2, layer.attn.proj.bias, layer.mlp.fc2.bias):
                p.copy_(0.5 * torch.randn_like(p))


@pytest.mark.parametrize("vision", ["6b", "300m"])
def test_inplace_residual_forward_equals_eager(vision) -> None:
    """The encoder through `fast_layer_inplace` (residuals added by the GEMM in place, layer scales folded into the
    weights, biases carried as a shift vector; eager, then compiled) = the eager encoder before folding, fp32; layer
    scales and biases away from 1 and 0 so the folding is tested."""
    enc, _ = build_pair(vision)
    randomize_scales(enc)
    px = torch.randn(3, 3, 112, 112)
    with torch.no_grad():
        ref = enc(px)
        fold_scales(enc)
        assert all(bool((layer.ls2 == 1).all()) for layer in enc.vit.layers)
        got = fast_forward_inplace(enc, px)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(CompiledEncoder(enc)(px), ref, atol=ATOL, rtol=RTOL)


def test_shifted_norm_kernel_in_the_interpreter() -> None:
    """norm(x + shift) through the kernel's SHIFT mode (TRITON_INTERPRET=1) = the reference and the norm modules;
    fp32 tightly, bf16 within 1e-2 by norm; masked widths, LayerNorm with and without bias, RMSNorm."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.fused_norm import shifted_norm, shifted_norm_reference
        from batchvl.ops.norm import RMSNorm
        torch.manual_seed(0)
        for C, rms, hnb in ((64, False, True), (100, True, False), (96, False, False)):
            x, shift = torch.randn(7, C), torch.randn(C)
            w, nb = 1 + 0.1 * torch.randn(C), torch.randn(C) if hnb else None
            norm = RMSNorm(C, 1e-6) if rms else torch.nn.LayerNorm(C, 1e-6, bias=hnb)
            with torch.no_grad():
                norm.weight.copy_(w)
                if hnb:
                    norm.bias.copy_(nb)
                want = norm(x + shift)
            torch.testing.assert_close(shifted_norm_reference(x, shift, w, nb, 1e-6, rms), want)
            torch.testing.assert_close(shifted_norm(x, shift, w, nb, 1e-6, rms), want, atol=1e-5, rtol=1e-5)
            xb, wb, nbb = x.bfloat16(), w.bfloat16(), nb.bfloat16() if hnb else None
            got = shifted_norm(xb, shift, wb, nbb, 1e-6, rms).float()
            ref = shifted_norm_reference(xb.float(), shift, wb.float(), nbb.float() if hnb else None, 1e-6, rms)
            assert ((got - ref).norm() / ref.norm()).item() < 1e-2
        print("ok")
        """
    )
    run_interpreted(code)


def test_qk_norm_kernel_in_the_interpreter() -> None:
    """The q/k RMSNorm (`qk_norm`: the kernel's shift mode with no shift, reading the q and k columns of the qkv rows
    where they lie; TRITON_INTERPRET=1) = its reference = the norm modules on q and k: fp32 tightly, bf16 within 1e-2
    by norm; a masked width, and qkv rows strided wider than 3C (columns of a larger buffer)."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.fused_norm import qk_norm, qk_norm_reference
        from batchvl.ops.norm import RMSNorm
        torch.manual_seed(0)
        for C, extra in ((100, 0), (64, 40)):
            qkv = torch.randn(7, 3 * C + extra)[:, : 3 * C]  # row stride 3C + extra
            norms = [RMSNorm(C, 1e-6) for _ in range(2)]
            with torch.no_grad():
                for n in norms:
                    n.weight.copy_(1 + 0.1 * torch.randn(C))
                want = torch.stack([n(qkv[:, i * C : (i + 1) * C]) for i, n in enumerate(norms)])
            wq, wk = (n.weight.detach() for n in norms)
            torch.testing.assert_close(qk_norm_reference(qkv, wq, wk, 1e-6), want)
            got = qk_norm(qkv, wq, wk, 1e-6)
            assert got.shape == (2, 7, C)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            got = qk_norm(qkv.bfloat16(), wq.bfloat16(), wk.bfloat16(), 1e-6).float()
            ref = qk_norm_reference(qkv.bfloat16().float(), wq.bfloat16().float(), wk.bfloat16().float(), 1e-6)
            assert ((got - ref).norm() / ref.norm()).item() < 1e-2
        print("ok")
        """
    )
    run_interpreted(code)


def test_norm_kernel_rows_per_program_in_the_interpreter() -> None:
    """`launch_config` gives each program 2048 columns' worth of rows; over several programs, the last one's rows
    partly past M (masked), the kernel writes what one row per program writes, bit for bit, for `shifted_norm`
    (RMSNorm, LayerNorm with and without bias) and `qk_norm` (rows 3C apart); each equals its reference in fp32."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops import fused_norm as fn
        from batchvl.ops.triton_support import triton_runs_on
        assert [fn.launch_config(C)[0] for C in (64, 100, 1024, 3200)] == [32, 16, 2, 1]
        default = fn.launch_config
        torch.manual_seed(0)
        M = 37  # 2 programs of 32 rows at C = 64, 3 of 16 at C = 96 and 100: the last one partly past M
        for C, rms, hnb in ((100, True, False), (64, False, True), (96, False, False)):
            x, shift, qkv = torch.randn(M, C), torch.randn(C), torch.randn(M, 3 * C)
            w, w2, nb = 1 + 0.1 * torch.randn(C), 1 + 0.1 * torch.randn(C), torch.randn(C) if hnb else None
            assert triton_runs_on(x)  # the kernel, not the reference fallback
            outs = []
            for cfg in (None, (1, 4), (4, 4)):
                fn.launch_config = default if cfg is None else (lambda C, cfg=cfg: cfg)
                outs.append((fn.shifted_norm(x, shift, w, nb, 1e-6, rms), fn.qk_norm(qkv, w, w2, 1e-6)))
            fn.launch_config = default
            for o in outs[1:]:
                assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))
            want = fn.shifted_norm_reference(x, shift, w, nb, 1e-6, rms)
            torch.testing.assert_close(outs[0][0], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[0][1], fn.qk_norm_reference(qkv, w, w2, 1e-6), atol=1e-5, rtol=1e-5)
        print("ok")
        """
    )
    run_interpreted(code)


def test_the_builder_picks_the_vit_path() -> None:
    """Default: the compiled in-place path; eager: the module itself; FP8: the plain compiled path over the
    encoder's layers made FP8 in place (the FP8 + tensor-parallel refusal: test_fp8.py)."""
    enc, _ = build_pair("300m")
    model = types.SimpleNamespace(vision=enc, cfg=enc.cfg)
    encode = vision_encoder(model, EngineSpec())
    assert isinstance(encode, CompiledEncoder) and encode.inplace
    assert vision_encoder(model, EngineSpec(eager=True)) is enc
    model8 = types.SimpleNamespace(vision=build_pair("300m")[0], cfg=enc.cfg)
    fp8 = vision_encoder(model8, EngineSpec(vit_fp8=True))
    assert isinstance(fp8, CompiledEncoder) and not fp8.inplace
    for layer in model8.vision.vit.layers:
        for lin in (layer.attn.qkv, layer.attn.proj, layer.mlp.fc1, layer.mlp.fc2):
            assert isinstance(lin, Fp8Linear)
