"""The fused residual + layer scale + norm pass: the op against the eager layer's sums, its Triton kernel (through
Triton's interpreter on CPU), and the compiled encoder with it against the eager encoder."""

from __future__ import annotations

import textwrap

import pytest
import torch
from test_bench import _run_interpreted
from test_internvit import build_pair

from batchvl.ops.fused_norm import norm_params, residual_norm
from batchvl.encoder.internvit import RMSNorm
from batchvl.encoder.internvit_compiled import compile_encoder, fast_forward

ATOL, RTOL = 1e-5, 1e-4


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_reference_is_the_eager_layer_sums(rms) -> None:
    """The op (CPU path) = x + ls * linear-with-bias output, then the norm module itself."""
    g = torch.Generator().manual_seed(0)
    C = 48
    norm = RMSNorm(C, eps=1e-6) if rms else torch.nn.LayerNorm(C, eps=1e-6)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    x, y = torch.randn(5, C, generator=g), torch.randn(5, C, generator=g)
    b, ls = torch.randn(C, generator=g), torch.randn(C, generator=g)
    with torch.no_grad():
        want_x = x + ls * (y + b)
        want_h = norm(want_x)
        got_x, got_h = residual_norm(x, y, b, ls, *norm_params(norm))
    torch.testing.assert_close(got_x, want_x, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_h, want_h, atol=ATOL, rtol=RTOL)


def test_triton_kernel_in_the_interpreter() -> None:
    """The kernel itself (TRITON_INTERPRET=1 runs it on CPU tensors): fp32 equal to the reference, bf16 within 1e-2
    by norm of fp32 sums on the same inputs; non-power-of-two widths (masked columns), with and without biases."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.fused_norm import _use_triton, residual_norm, residual_norm_reference
        assert _use_triton(torch.zeros(1))  # the interpreter path, not the CPU fallback
        assert not _use_triton(torch.zeros(1, 8193))  # too wide for one row in registers: the reference
        torch.manual_seed(0)
        worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
        for dt in worst:
            for C, rms, hb, hnb in ((64, False, True, True), (100, True, True, False), (96, False, False, False)):
                x, y = torch.randn(7, C), torch.randn(7, C)
                b, nb = torch.randn(C) if hb else None, torch.randn(C) if hnb else None
                ls, w = torch.randn(C), 1 + 0.1 * torch.randn(C)
                args = [t.to(dt) if t is not None else None for t in (x, y, b, ls, w, nb)]
                got = residual_norm(*args, 1e-6, rms)
                f32 = [t.float() if t is not None else None for t in args]
                ref = residual_norm_reference(*f32, 1e-6, rms)
                for g, r in zip(got, ref):
                    worst[dt] = max(worst[dt], ((g.float() - r).norm() / r.norm()).item())
        assert worst[torch.float32] < 1e-6, worst
        assert worst[torch.bfloat16] < 1e-2, worst
        print("ok", worst)
        """
    )
    _run_interpreted(code)


def test_kernel_rows_per_program_in_the_interpreter() -> None:
    """`_launch` with several rows per program (the last program's rows partly past M: masked) writes what one row
    per program writes, bit for bit, for the residual and the shifted modes, RMSNorm and LayerNorm; and each equals
    the reference in fp32."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.fused_norm import _launch, residual_norm_reference, shifted_norm_reference
        torch.manual_seed(0)
        for C, rms in ((100, True), (64, False)):
            x, y, b, ls = torch.randn(7, C), torch.randn(7, C), torch.randn(C), torch.randn(C)
            w, nb, shift = 1 + 0.1 * torch.randn(C), torch.randn(C), torch.randn(C)
            outs = []
            for cfg in ((1, 4), (2, 4), (4, 8), (8, 4)):
                xo, ho, hs = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
                _launch(x, y, b, ls, w, nb, xo, ho, 1e-6, rms, shift=False, cfg=cfg)
                _launch(x, shift, None, None, w, nb, x, hs, 1e-6, rms, shift=True, cfg=cfg)
                outs.append((xo, ho, hs))
            for o in outs[1:]:
                assert all(torch.equal(a, b_) for a, b_ in zip(o, outs[0]))
            want = residual_norm_reference(x, y, b, ls, w, nb, 1e-6, rms)
            torch.testing.assert_close(outs[0][0], want[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[0][1], want[1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[0][2], shifted_norm_reference(x, shift, w, nb, 1e-6, rms), atol=1e-5,
                                       rtol=1e-5)
        print("ok")
        """
    )
    _run_interpreted(code)


@pytest.mark.parametrize("vision", ["6b", "300m"])
def test_fused_forward_equals_eager(vision) -> None:
    """The encoder through `fast_layer_fused` (eager and compiled: the op traced as one node) = the eager encoder;
    6B-style (RMSNorm, qk-norm, no qkv bias) and 300M-style (LayerNorm, qkv bias), with and without the epilogue."""
    enc, _ = build_pair(vision)
    px = torch.randn(3, 3, 112, 112)
    with torch.no_grad():
        ref = enc(px)
        got = fast_forward(enc, px, gelu_epilogue=False, fused_norm=True)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    got = compile_encoder(enc, buckets=[4], gelu_epilogue=vision == "6b", fused_norm=True)(px)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def randomize_scales(enc) -> None:
    """Layer scales and the proj / fc2 biases drawn away from 1 and 0, so folding them is tested."""
    with torch.no_grad():
        for layer in enc.vit.layers:
            for p in (layer.ls1, layer.ls2, layer.attn.proj.bias, layer.mlp.fc2.bias):
                p.copy_(0.5 * torch.randn_like(p))


@pytest.mark.parametrize("vision", ["6b", "300m"])
def test_inplace_residual_forward_equals_eager(vision) -> None:
    """The encoder through `fast_layer_inplace` (residuals added by the GEMM in place, layer scales folded into the
    weights, biases carried as a shift vector; eager and compiled) = the eager encoder, fp32; layer scales and
    biases away from 1 and 0 so the folding is tested."""
    from batchvl.encoder.internvit_compiled import fast_forward_inplace, fold_scales

    enc, _ = build_pair(vision)
    randomize_scales(enc)
    px = torch.randn(3, 3, 112, 112)
    with torch.no_grad():
        ref = enc(px)
        got = fast_forward_inplace(enc, px, fold_scales(enc))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    got = compile_encoder(enc, buckets=[4], gelu_epilogue=vision == "6b", inplace_residual=True)(px)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_fold_in_place_copies_nothing_and_keeps_the_function(monkeypatch) -> None:
    """`CompiledEncoder(fold_in_place=True)` folds the layer scales into the encoder's own proj / fc2 weights and
    biases (its ls1 / ls2 become ones): the eager module then computes what it did before (fp32, tightly), nothing
    is left to copy (so the auto rule turns the in-place residuals on at any size), the folded entries are the
    module's own weights, and the compiled encoder equals the eager one."""
    from batchvl.encoder import internvit_compiled

    enc, _ = build_pair("6b")
    randomize_scales(enc)
    px = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        ref = enc(px)
    assert internvit_compiled.fold_copy_bytes(enc) > 0
    # as if the copies were too large (the 6B's 4.6 GB)
    monkeypatch.setattr(internvit_compiled, "INPLACE_AUTO_MAX_BYTES", 0)
    assert not compile_encoder(enc, buckets=[2]).inplace_residual  # copies would be needed: off
    ce = compile_encoder(enc, buckets=[2], fold_in_place=True)
    assert ce.inplace_residual and internvit_compiled.fold_copy_bytes(enc) == 0
    for layer in enc.vit.layers:
        assert bool((layer.ls1 == 1).all()) and bool((layer.ls2 == 1).all())
    with torch.no_grad():
        torch.testing.assert_close(enc(px), ref, atol=ATOL, rtol=RTOL)  # the same function
    torch.testing.assert_close(ce(px), ref, atol=ATOL, rtol=RTOL)
    layer0 = enc.vit.layers[0]
    assert ce.folded[0][0].data_ptr() == layer0.attn.proj.weight.data_ptr()  # no copy
    assert ce.folded[0][2].data_ptr() == layer0.mlp.fc2.weight.data_ptr()


def test_shifted_norm_kernel_in_the_interpreter() -> None:
    """norm(x + shift) through the kernel's SHIFT mode (TRITON_INTERPRET=1) = the reference and the norm modules;
    fp32 tightly, bf16 within 1e-2 by norm; masked widths, LayerNorm with and without bias, RMSNorm."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.fused_norm import shifted_norm, shifted_norm_reference
        from batchvl.encoder.internvit import RMSNorm
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
    _run_interpreted(code)


def test_qk_norm_kernel_in_the_interpreter() -> None:
    """The q/k RMSNorm (`qk_norm`: the kernel's shift mode with no shift, reading the q and k columns of the qkv rows
    where they lie; TRITON_INTERPRET=1) = its reference = the norm modules on q and k: fp32 tightly, bf16 within 1e-2
    by norm; a masked width, and qkv rows strided wider than 3C (columns of a larger buffer)."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.fused_norm import qk_norm, qk_norm_reference
        from batchvl.encoder.internvit import RMSNorm
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
    _run_interpreted(code)


def test_job_option_reaches_the_encoder() -> None:
    """`engine.vit_inplace_residual` builds the in-place encoder (and refuses FP8 layers with a clear error)."""
    import types

    from batchvl.engine import EngineConfig
    from batchvl.runner import vision_encoder

    enc, _ = build_pair("300m")
    encode = vision_encoder(
        types.SimpleNamespace(vision=enc), enc.cfg, EngineConfig(vit_inplace_residual=True), None
    )
    assert encode.inplace_residual and encode.folded is None  # folded on the first call
    assert encode.triton_attn  # engine.vit_triton_attention's default
    px = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        torch.testing.assert_close(encode(px), enc(px), atol=ATOL, rtol=RTOL)
    assert len(encode.folded) == len(enc.vit.layers)
    off = EngineConfig(vit_triton_attention=False, vit_inplace_residual=False)
    off = vision_encoder(types.SimpleNamespace(vision=enc), enc.cfg, off, None)
    assert not off.triton_attn and not off.inplace_residual
    with pytest.raises(ValueError, match="inplace_residual"):
        vision_encoder(
            types.SimpleNamespace(vision=enc),
            enc.cfg,
            EngineConfig(vit_inplace_residual=True, vit_fp8=True),
            None,
        )


def test_inplace_residual_auto_follows_the_weight_copies_size(monkeypatch) -> None:
    """`inplace_residual=None` (the default; `engine.vit_inplace_residual: null`) turns the in-place path on when the
    proj / fc2 copies fit the limit (the tiny encoder's do), off when they do not (the limit lowered below them), and
    off for FP8 layers. The runner folds the layer scales into its model's weights, so it copies nothing and is in
    place under any limit."""
    import types

    from batchvl.encoder import internvit_compiled
    from batchvl.encoder.fp8 import fp8_vit
    from batchvl.engine import EngineConfig
    from batchvl.runner import vision_encoder

    enc, _ = build_pair("300m")
    ecfg = EngineConfig()
    assert ecfg.vit_inplace_residual is None
    assert compile_encoder(enc).inplace_residual
    copies = sum(la.attn.proj.weight.nbytes + la.mlp.fc2.weight.nbytes for la in enc.vit.layers)
    monkeypatch.setattr(internvit_compiled, "INPLACE_AUTO_MAX_BYTES", copies - 1)
    assert not compile_encoder(enc).inplace_residual
    assert vision_encoder(types.SimpleNamespace(vision=enc), enc.cfg, ecfg, None).inplace_residual
    monkeypatch.setattr(internvit_compiled, "INPLACE_AUTO_MAX_BYTES", copies)
    assert compile_encoder(build_pair("300m")[0]).inplace_residual
    assert not compile_encoder(fp8_vit(enc)).inplace_residual
