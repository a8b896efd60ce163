"""Fast (regionally compiled) InternViT forward vs the eager reference, fp32 on CPU."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from test_internvit import build_pair, make_cfg

from batchvl.encoder.internvit import VisionEncoder
from batchvl.encoder.internvit_compiled import (
    CompiledEncoder,
    bucket_for,
    bucket_plan,
    default_buckets,
    fast_forward,
    padded_fraction,
    patch_embed_gemm,
)

ATOL, RTOL = 1e-5, 1e-4


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_buckets() -> None:
    assert default_buckets(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert default_buckets(12) == [1, 2, 4, 8, 12]
    b = default_buckets(64)
    assert [bucket_for(n, b) for n in (1, 3, 5, 16, 17, 33, 64)] == [1, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError):
        bucket_for(65, b)
    assert padded_fraction(16, b) == 0 and padded_fraction(131, b) == pytest.approx(1 - 131 / 132)
    # a rest runs as exact buckets while they are >= 16, then pads: 231 = 128 + 96 + 7 (-> 8), not 128 + 112
    b128 = default_buckets(128)
    assert bucket_plan(231, b128) == [128, 96, 8]
    assert padded_fraction(231, b128) == pytest.approx(1 - 231 / 232)
    assert bucket_plan(17, b128) == [16, 1] and bucket_plan(31, b128) == [16, 16]
    assert bucket_plan(9, b128) == [16] and bucket_plan(20, [4, 16, 32]) == [16, 4]
    assert bucket_plan(300, b128) == [128, 128, 32, 16] and bucket_plan(0, b128) == []
    assert bucket_plan(9, [4]) == [4, 4, 4] and bucket_plan(3, [2, 4]) == [4]


@pytest.mark.parametrize("kind", ["6b", "300m"])
def test_fast_forward_eager_equals_reference(kind: str) -> None:
    """Uncompiled, the plain fast path is the reference math with other graph boundaries: with the reference's patch
    conv, bit for bit (fc1 + GELU as one addmm-with-activation computes exact GELU on CPU); with the patch conv as
    one GEMM over unfolded patches, the same sums in another order."""
    enc, _ = build_pair(kind)
    px = torch.randn(3, 3, 112, 112)

    def conv_embed(emb, norm1, px):  # the reference's patch conv: everything else must then be bit-identical
        x = emb(px)
        return x, norm1(x)

    with torch.no_grad():
        torch.testing.assert_close(fast_forward(enc, px, embed=conv_embed), enc(px), atol=0, rtol=0)
        torch.testing.assert_close(fast_forward(enc, px), enc(px), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("size", [(112, 112), (125, 98)])
def test_patch_embed_gemm_equals_conv(size: tuple[int, int]) -> None:
    """Unfold + GEMM == the stride-p conv, also on sizes that do not divide by the patch (the conv drops the rest)."""
    conv = torch.nn.Conv2d(3, 40, kernel_size=14, stride=14)
    px = torch.randn(2, 3, *size)
    x, gh, gw = patch_embed_gemm(conv, px)
    with torch.no_grad():
        ref = conv(px)  # [B, C, gh, gw]
    assert (gh, gw) == tuple(ref.shape[2:])
    torch.testing.assert_close(x, ref.flatten(2).transpose(1, 2), atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_compiled_matches_eager_no_recompile_within_bucket() -> None:
    """6B-style: tile counts 1..4 over buckets [2, 4] compile each bucket once, and match the eager encoder as it was
    before `CompiledEncoder` folded the layer scales into its weights (the folded module itself computes the same
    function: fp32, up to one rounding of ls * W)."""
    torch._dynamo.reset()  # graph counts below assume no earlier test compiled these functions at these shapes
    enc, _ = build_pair("6b")
    eager = copy.deepcopy(enc)
    ce = CompiledEncoder(enc, buckets=[2, 4])  # folds the layer scales into enc's weights
    assert ce.inplace and all(bool((layer.ls1 == 1).all()) for layer in enc.vit.layers)
    assert not all(bool((layer.ls1 == 1).all()) for layer in eager.vit.layers)  # so the folding is tested
    torch.manual_seed(1)
    with torch.no_grad():
        px = torch.randn(3, 3, 112, 112)
        torch.testing.assert_close(enc(px), eager(px), atol=ATOL, rtol=RTOL)
    for n in (3, 4, 1, 2, 3):
        px = torch.randn(n, 3, 112, 112)
        g0 = _graphs()
        got = ce(px)
        new = _graphs() - g0
        with torch.no_grad():
            ref = eager(px)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
        if n in (4, 2) or (n == 3 and ce.stats.calls > 1):
            assert new == 0, f"{n} tiles recompiled {new} graphs in an already compiled bucket"
    with torch.inference_mode():  # how the engine calls it: no recompiles after the no_grad calls above
        g0 = _graphs()
        ce(torch.randn(4, 3, 112, 112))
        assert _graphs() == g0
    assert sorted(ce.stats.compile_s) == [2, 4]
    # embed, layer (with next norm), last layer, head: 4 graphs per bucket, and no more
    assert ce.stats.graphs == {4: 4, 2: 4}
    assert ce.stats.padded_tiles == 1 + 1 + 1  # 3->4, 1->2, 3->4
    assert "vit compile" in ce.stats.summary()


@pytest.mark.slow
def test_warmup_compiles_every_graph_through_two_layers() -> None:
    """The warm-up runs each bucket through the first and last layers only, yet compiles everything the whole
    encoder needs: afterwards a full call of each bucket compiles nothing and equals eager."""
    torch._dynamo.reset()
    cfg = make_cfg("6b")
    torch.manual_seed(0)
    enc = VisionEncoder(
        replace(cfg, vision=replace(cfg.vision, num_layers=4))
    ).eval()  # the warm-up skips two
    eager = copy.deepcopy(enc)
    ce = CompiledEncoder(enc, buckets=[1, 2])
    ce.warmup()
    assert ce.stats.graphs == {1: 4, 2: 4}  # embed, layer with next norm, last layer, head
    for n in (2, 1):
        px = torch.randn(n, 3, 112, 112)
        g0 = _graphs()
        got = ce(px)
        assert _graphs() == g0, f"{n} tiles compiled after the warm-up"
        with torch.no_grad():
            torch.testing.assert_close(got, eager(px), atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_compiled_300m_chunks_over_largest_bucket() -> None:
    """300M-style (LayerNorm, qkv bias): 9 tiles with one bucket of 4 run as 4+4+1(padded), one compile."""
    enc, _ = build_pair("300m")
    eager = copy.deepcopy(enc)  # the reference, unfolded
    ce = CompiledEncoder(enc, buckets=[4])
    px = torch.randn(9, 3, 112, 112)
    got = ce(px)
    with torch.no_grad():
        ref = eager(px)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    assert list(ce.stats.compile_s) == [4] and ce.stats.padded_tiles == 3
    # a rest split into exact buckets: 20 tiles over [4, 16, 32] run as 16 + 4, no padding, still equal to eager
    # (a second CompiledEncoder of the already folded enc)
    ce = CompiledEncoder(enc, buckets=[4, 16, 32])
    px = torch.randn(20, 3, 112, 112)
    got = ce(px)
    with torch.no_grad():
        ref = eager(px)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    assert sorted(ce.stats.compile_s) == [4, 16] and ce.stats.padded_tiles == 0
