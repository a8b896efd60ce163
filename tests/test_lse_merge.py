"""The log-sum-exp merge of the cascade prefill: the reference against attention over the union of the keys, and the
Triton kernel (through Triton's interpreter on CPU) against the reference."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import run_interpreted

from batchvl.ops.lse_merge import merge_attn_reference_


def _attn(q, k, v):
    """q [T, H, D], k / v [S, H, D] -> (out [T, H, D], lse [H, T]), in float64."""
    s = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    lse = s.logsumexp(-1)
    return torch.einsum("hts,shd->thd", (s - lse[..., None]).exp(), v), lse


def test_merging_two_key_sets_equals_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 4, 32, generator=g, dtype=torch.float64) * 2 for n in (9, 30, 30))
    want, _ = _attn(q, k, v)
    o_a, lse_a = _attn(q, k[:7], v[:7])
    o_b, lse_b = _attn(q, k[7:], v[7:])
    merge_attn_reference_(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o_a, want, rtol=1e-12, atol=1e-12)


def test_kernel_in_the_interpreter() -> None:
    """`merge_attn_` through the Triton kernel (TRITON_INTERPRET=1) equals the reference: token counts that fill
    and miss a program's block, a log-sum-exp sliced from a wider one (its head stride), an output written in place
    through a slice, fp32 and fp16."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from batchvl.ops.lse_merge import kernel_ok, merge_attn_, merge_attn_reference_
        torch.manual_seed(0)
        for dt in (torch.float32, torch.float16):
            for t in (1, 32, 77):
                o = torch.randn(t + 5, 3, 64).to(dt)
                ob = torch.randn(t, 3, 64).to(dt)
                lse = torch.randn(3, t + 5) * 4
                lb = torch.randn(3, t) * 4
                want = o[:t].clone()
                merge_attn_reference_(want, lse[:, :t], ob, lb)
                assert kernel_ok(o[:t], lse[:, :t], ob, lb)
                rest = o[t:].clone()
                merge_attn_(o[:t], lse[:, :t], ob, lb)
                tol = 1e-6 if dt == torch.float32 else 2e-3
                assert float((o[:t].float() - want.float()).norm() / want.float().norm()) < tol, (dt, t)
                assert torch.equal(o[t:], rest)  # rows past the slice untouched
        assert not kernel_ok(*(torch.randn(4, 2, 24), torch.randn(2, 4), torch.randn(4, 2, 24), torch.randn(2, 4)))
        print("ok")
        """
    )
    run_interpreted(code)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton compiles for a GPU only)")
def test_the_kernel_compiles_once_for_every_token_count():
    """A job's prefill batches bring token counts of every residue mod 16; the warm-up meets one. Each specialized
    variant would be compiled on the job's clock (bench/RESULTS.md, session 28)."""
    from batchvl.ops.lse_merge import _merge_kernel, merge_attn_

    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (144, 605, 1, 16377):  # divisible by 16, odd, one, odd
        o_a, o_b = (
            torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)
        )
        lse_a, lse_b = (torch.randn(8, t, device="cuda", generator=g) for _ in range(2))
        want = o_a.clone()
        merge_attn_reference_(want, lse_a, o_b, lse_b)
        merge_attn_(o_a, lse_a, o_b, lse_b)
        torch.testing.assert_close(o_a, want, atol=1e-2, rtol=2**-7)  # one bf16 ulp apart at most
    kernels = _merge_kernel.device_caches[torch.cuda.current_device()][0]  # this device's compiled variants
    assert len(kernels) == 1
