"""FP8 ViT linears (opt-in): the quantization, the scaled product against its dequantized reference, the encoder
against the fp32 reference (an accuracy bound, not equality), compiled against eager, and a whole job (CPU)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from test_internvit import build_pair

from batchvl.encoder.fp8 import fp8_vit
from batchvl.encoder.internvit_compiled import CompiledEncoder
from batchvl.job import EngineSpec
from batchvl.model.build import vision_encoder
from batchvl.ops.fp8 import FP8_MAX, Fp8Linear, dequantized_weight, quantize_rows


def test_quantize_rows_scales_each_row_to_the_e4m3_range() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 96) * torch.logspace(-3, 3, 16)[:, None]  # rows of very different magnitude
    x[3] = 0  # an all-zero row must not divide by zero
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (16, 1)
    torch.testing.assert_close(q.float().abs().amax(1)[s[:, 0] > 1e-10], torch.full((15,), FP8_MAX))
    back = q.float() * s
    assert torch.isfinite(back).all() and (back[3] == 0).all()
    # e4m3 keeps 3 mantissa bits: each element within half a step (2^-4 relative) of itself, or below the
    # smallest normal of its row's scale
    err = (back - x).abs()
    assert (err <= x.abs() * 2**-4 + s * 2**-6).all()


def test_fp8_linear_quantizes_a_weight_in_row_blocks_as_in_one() -> None:
    """`quantize_from` in blocks of rows (bounded temporaries) == `quantize_rows` of the whole weight, bit for bit."""
    torch.manual_seed(2)
    w = torch.randn(48, 32) * torch.logspace(-2, 2, 48)[:, None]
    q, s = quantize_rows(w)
    f8 = Fp8Linear(32, 48)
    f8.quantize_from(w, rows=20)  # blocks of 20, 20 and 8 rows
    assert torch.equal(f8.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(f8.weight_scale, s.reshape(1, -1))
    with pytest.raises(ValueError, match="for an Fp8Linear"):
        f8.quantize_from(w.t())


def test_fp8_linear_equals_its_dequantized_product() -> None:
    """_scaled_mm with row-wise scales == (dequantized x) @ (dequantized w)^T in fp32, rounded to bf16, + bias."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 48)
    f8 = Fp8Linear.from_linear(lin)
    x = torch.randn(2, 5, 64)
    xq, xs = quantize_rows(x.reshape(-1, 64))
    want = ((xq.float() * xs) @ dequantized_weight(f8).t()).to(torch.bfloat16).float() + lin.bias
    got = f8(x)
    assert got.shape == (2, 5, 48) and got.dtype == x.dtype
    torch.testing.assert_close(got.reshape(-1, 48), want, rtol=2**-8, atol=1e-6)
    # and it is an approximation of the fp32 linear, within e4m3's precision
    rel = float((got - lin(x)).norm() / lin(x).norm())
    assert rel < 0.06, rel


def test_fp8_linear_refuses_shapes_scaled_mm_cannot_take() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear.from_linear(torch.nn.Linear(64, 40))


def test_fp8_vit_swaps_the_layer_linears_only() -> None:
    enc, _ = build_pair("6b")
    fp8_vit(enc)
    kinds = {n: type(m).__name__ for n, m in enc.named_modules()}
    for i in range(len(enc.vit.layers)):
        for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
            assert kinds[f"vit.layers.{i}.{name}"] == "Fp8Linear"
    assert sum(k == "Fp8Linear" for k in kinds.values()) == 4 * len(enc.vit.layers)
    assert kinds["vit.embeddings.patch_embedding"] == "Conv2d"
    assert all(k != "Fp8Linear" for n, k in kinds.items() if n.startswith("projector"))


@pytest.mark.parametrize("kind", ["6b", "300m"])
def test_fp8_encoder_accuracy_and_compiled_equals_eager(kind: str) -> None:
    enc, _ = build_pair(kind)
    ref_enc = copy.deepcopy(enc)
    fp8_vit(enc)
    px = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        ref, eager = ref_enc(px), enc(px)
    rel = float((eager - ref).norm() / ref.norm())
    assert 0 < rel < 1e-2, rel  # e4m3 activations and weights on every layer linear (here ~1e-3)
    got = CompiledEncoder(enc)(px)
    # compiled == eager up to the last bits of the norms feeding the quantization (a rare e4m3 rounding flip)
    assert float((got - eager).norm() / eager.norm()) < 5e-4


def test_fp8_refuses_a_tensor_parallel_vit() -> None:
    """The builder refuses FP8 for a ViT over a tensor-parallel group, naming the setting."""
    enc, _ = build_pair("300m")
    ctx = types.SimpleNamespace(tp=2, tp_group=None)
    with pytest.raises(ValueError, match="vit_fp8"):
        vision_encoder(types.SimpleNamespace(vision=enc, cfg=enc.cfg), EngineSpec(vit_fp8=True), ctx)


@pytest.mark.slow
def test_demo_job_with_fp8_vit(tmp_path) -> None:
    """The whole demo job with `engine.vit_fp8: true`: every row succeeds, the manifest records fp8 as on."""
    from test_runner import DEMO_IDS, by_id, run_cli

    from batchvl.output import read_manifest

    p = run_cli("jobs/demo.yaml", "--set", f"output.dir={tmp_path / 'run'}", "--set", "engine.vit_fp8=true")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = by_id(tmp_path / "run")
    assert sorted(rows) == DEMO_IDS and all(r["error"] is None for r in rows.values())
    assert read_manifest(tmp_path / "run")["job"]["engine"]["vit_fp8"] is True
