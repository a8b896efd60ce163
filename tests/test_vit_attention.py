"""The CLS-aware ViT attention (`ops/vit_attention.py`): its reference against the eager layer's `mix`, its Triton
kernel through Triton's interpreter on CPU (fp32 tightly, fp16 within its rounding; pointer and TMA loads), and the
encoder through the kernel (residual stream plain or in place) against the eager encoder."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import run_interpreted
from test_internvit import build_pair

from batchvl.encoder.internvit_compiled import CompiledEncoder, fast_mix
from batchvl.ops.vit_attention import (
    kernel_config,
    vit_attention,
    vit_attention_reference,
    vit_attention_sdpa,
)

ATOL, RTOL = 1e-5, 1e-4


@pytest.mark.parametrize("vision", ["6b", "300m"])
def test_reference_and_cpu_op_are_the_eager_mix(vision) -> None:
    """On CPU the op runs its reference, which is `InternViTAttention.mix` from the same qkv rows (q/k RMSNorm over
    the full width for 6B); `fast_mix` falls back to the same sums."""
    enc, _ = build_pair(vision)
    attn = enc.vit.layers[0].attn
    B, T, C = 3, 65, enc.cfg.vision.hidden_size
    h = torch.randn(B, T, C)
    H = C // attn.head_dim
    norm = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if vision == "6b" else (None, None, 0.0)
    with torch.no_grad():
        want = attn.mix(h).reshape(B * T, C)
        qkv = attn.qkv(h).reshape(B * T, 3 * C)
        assert kernel_config(qkv, T, H) is None  # CPU, fp32: never the kernel
        torch.testing.assert_close(vit_attention_reference(qkv, T, H, attn.head_dim**-0.5, *norm), want)
        torch.testing.assert_close(vit_attention(qkv, T, H, attn.head_dim**-0.5, *norm), want)
        torch.testing.assert_close(vit_attention_sdpa(qkv, T, H, attn.head_dim**-0.5, *norm), want)
        torch.testing.assert_close(fast_mix(attn, h), want)


def test_kernel_in_the_interpreter() -> None:
    """`_vit_attention_triton` (TRITON_INTERPRET=1) = the reference over all rows, the CLS row included: pointer and
    TMA loads, BLOCK_M = / != BLOCK_N, with and without the folded q/k RMSNorm; fp32 below 1e-6 by norm, fp16 below
    2e-3 against fp32 sums. Then the op's own dispatch (`CONFIGS`) at T = 1 + 256, and where it must not run."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.vit_attention import (
            _vit_attention_triton, kernel_config, vit_attention, vit_attention_reference)
        torch.manual_seed(0)
        worst = {}
        for cfg in ((16, 32, 4, 1), (32, 16, 4, 1), (16, 16, 4, 1), (16, 32, 4, 1, True), (32, 32, 4, 1, True)):
            for norm in (False, True):
                for dt in (torch.float32, torch.float16):
                    B, T, H, D = 2, 1 + 64, 3, 32
                    C = H * D
                    qkv = (torch.randn(B * T, 3 * C) * 1.5).to(dt)
                    w = [(1 + 0.3 * torch.randn(C)).to(dt) for _ in range(2)] if norm else [None, None]
                    got = _vit_attention_triton(qkv, T, H, D**-0.5, *w, 1e-6, cfg).float()
                    wf = [t.float() if t is not None else None for t in w]
                    ref = vit_attention_reference(qkv.float(), T, H, D**-0.5, *wf, 1e-6)
                    err = float((got - ref).norm() / ref.norm())
                    err0 = float((got[::T] - ref[::T]).norm() / ref[::T].norm())  # the CLS rows alone
                    worst[dt] = max(worst.get(dt, 0.0), err, err0)
        assert worst[torch.float32] < 1e-6 and worst[torch.float16] < 2e-3, worst
        B, T, H, D = 2, 1 + 256, 2, 64
        qkv = torch.randn(B * T, 3 * H * D)
        assert kernel_config(qkv, T, H) is not None
        assert kernel_config(qkv, 1 + 64, H) is None  # T - 1 not whole BLOCK_M blocks
        assert kernel_config(torch.randn(B * T, 3 * 2 * 128), T, 2) is None  # head_dim 128: no entry
        assert kernel_config(torch.empty(32768 * T, 3 * H * D, device="meta"), T, H) is None  # grid y > 65535
        w = [1 + 0.3 * torch.randn(H * D) for _ in range(2)]
        for norm in ([None, None], w):
            got, ref = vit_attention(qkv, T, H, 0.125, *norm, 1e-6), vit_attention_reference(qkv, T, H, 0.125, *norm, 1e-6)
            assert float((got - ref).norm() / ref.norm()) < 1e-6
        print("ok", worst)
        """
    )
    run_interpreted(code)


def test_encoder_through_the_kernel_in_the_interpreter() -> None:
    """The whole encoder with attention through the kernel (6B-style: qk-norm folded in; 300M-style: qkv bias),
    head_dim 64 at 16 x 16 patches (T = 257), equals the eager encoder in fp32; also with the residuals in place
    (`fast_forward_inplace`, the default path, after folding the layer scales; the reference taken before). At
    head_dim 128 (no kernel config: the 6B's way) the same through `vit_attention_sdpa`, its q/k RMSNorm in the
    Triton norm kernel."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, "tests")
        from test_internvit import build_pair
        from batchvl.encoder.internvit_compiled import fast_forward, fast_forward_inplace, fold_scales
        for vision, hidden in (("6b", 128), ("300m", 128), ("6b", 256)):
            enc, _ = build_pair(vision, image_size=224, hidden=hidden, heads=2)
            px = torch.randn(2, 3, 224, 224)
            with torch.no_grad():
                ref = enc(px)
                got = fast_forward(enc, px)
                fold_scales(enc)
                got_ip = fast_forward_inplace(enc, px)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got_ip, ref, atol=1e-5, rtol=1e-4)
        print("ok")
        """
    )
    run_interpreted(code)


def test_compiled_encoder_default_equals_eager_on_cpu() -> None:
    """The compiled encoder traces `fast_mix`'s fallback on CPU: equal to eager."""
    enc, _ = build_pair("6b")
    px = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        ref = enc(px)
    ce = CompiledEncoder(enc)
    torch.testing.assert_close(ce(px), ref, atol=ATOL, rtol=RTOL)


def test_fast_mix_keeps_the_module_path_for_other_norms() -> None:
    """A q/k norm that is not a plain RMSNorm (TP's ShardedRMSNorm all-reduces its mean square) is not read as
    weights: `fast_mix` then runs the module's own `mix`, norms called as modules."""

    class Doubled(torch.nn.Module):
        def __init__(self, norm: torch.nn.Module) -> None:
            super().__init__()
            self.norm, self.weight, self.eps = norm, norm.weight, norm.eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.norm(x)

    enc, _ = build_pair("6b")
    attn = enc.vit.layers[0].attn
    attn.q_norm = Doubled(attn.q_norm)
    h = torch.randn(2, 65, enc.cfg.vision.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(fast_mix(attn, h), attn.mix(h).reshape(2 * 65, -1))
