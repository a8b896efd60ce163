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
    fast_forward,
    patch_embed_gemm,
)

ATOL, RTOL = 1e-5, 1e-4


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


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


def _spy_chunks(ce: CompiledEncoder) -> list[int]:
    """Record the tile count of every compiled forward `ce` runs."""
    sizes, run = [], ce._run

    def spy(px, layers=None):
        sizes.append(px.shape[0])
        return run(px, layers)

    ce._run = spy
    return sizes


@pytest.mark.slow
def test_compiled_matches_eager_at_any_tile_count() -> None:
    """6B-style: odd tile counts that buckets used to pad, and a count over max_tiles (chunked), run unpadded through
    one set of graphs (compiled by the first call, nothing after; a lone tile runs beside a zero tile), and match the eager
    encoder as it was before `CompiledEncoder` folded the layer scales into its weights (the folded module itself
    computes the same function: fp32, up to one rounding of ls * W)."""
    torch._dynamo.reset()  # graph counts below assume no earlier test compiled these functions
    enc, _ = build_pair("6b")
    eager = copy.deepcopy(enc)
    ce = CompiledEncoder(enc, max_tiles=4)  # folds the layer scales into enc's weights
    assert ce.inplace and all(bool((layer.ls1 == 1).all()) for layer in enc.vit.layers)
    assert not all(bool((layer.ls1 == 1).all()) for layer in eager.vit.layers)  # so the folding is tested
    torch.manual_seed(1)
    with torch.no_grad():
        px = torch.randn(3, 3, 112, 112)
        torch.testing.assert_close(enc(px), eager(px), atol=ATOL, rtol=RTOL)
    chunks = _spy_chunks(ce)
    for i, n in enumerate((3, 1, 2, 5, 7, 9, 4, 1, 3)):
        px = torch.randn(n, 3, 112, 112)
        g0 = _graphs()
        got = ce(px)
        new = _graphs() - g0
        with torch.no_grad():
            ref = eager(px)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
        if i >= 1:  # the first call (3 tiles) compiled; every other count, 1 included, runs its graphs
            assert new == 0, f"{n} tiles compiled {new} graphs"
    # the chunks the calls ran: 1 -> padded to 2; over max_tiles 4, 5 -> 3 + 2, 7 -> 4 + 3, 9 -> 3 + 3 + 3
    assert chunks == [3, 2, 2, 3, 2, 4, 3, 3, 3, 3, 4, 2, 3]
    with torch.inference_mode():  # how the engine calls it: no recompiles after the no_grad calls above
        g0 = _graphs()
        ce(torch.randn(6, 3, 112, 112))
        assert _graphs() == g0
    # embed, layer (the last too), head: 3 graphs, and no more
    assert ce.stats.graphs == 3
    assert (ce.stats.calls, ce.stats.tiles, ce.stats.padded_tiles) == (10, 41, 2)
    assert "vit compile" in ce.stats.summary()


@pytest.mark.slow
def test_warmup_compiles_every_graph_through_two_layers() -> None:
    """300M-style (LayerNorm, qkv bias): the warm-up runs max_tiles tiles through the first and last layers
    only, yet compiles everything the whole encoder needs: afterwards full calls of any tile count, chunked over
    max_tiles too, compile nothing and equal eager."""
    torch._dynamo.reset()
    cfg = make_cfg("300m")
    torch.manual_seed(0)
    enc = VisionEncoder(
        replace(cfg, vision=replace(cfg.vision, num_layers=4))
    ).eval()  # the warm-up skips two
    eager = copy.deepcopy(enc)
    ce = CompiledEncoder(enc, max_tiles=3)
    ce.warmup()
    assert ce.stats.graphs == 3  # embed, layer (the last too), head
    g0 = _graphs()
    for n in (2, 1, 3, 5, 7):
        px = torch.randn(n, 3, 112, 112)
        got = ce(px)
        assert _graphs() == g0, f"{n} tiles compiled after the warm-up"
        with torch.no_grad():
            torch.testing.assert_close(got, eager(px), atol=ATOL, rtol=RTOL)
