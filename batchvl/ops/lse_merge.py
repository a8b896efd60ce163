"""Merging two attentions of the same queries over disjoint key sets into the attention over their union, from each
one's output and log-sum-exp (the cascade prefill after a shared prefix: `prefill_attention.causal_attn_packed`).

    merge_attn_(o_a, lse_a, o_b, lse_b)   # o [T, H, D], lse [H, T] float32; o_a becomes the merged output

The reference (`merge_attn_reference_`) takes three passes over the outputs in float32. On CUDA in bf16 / fp16 (and
under Triton's interpreter) one Triton kernel reads both outputs once and writes the result in place: a program per
(block of tokens, head), weights exp(lse - logaddexp) in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchvl.ops.triton_support import interpreting, tl, triton

TOKENS_PER_PROGRAM = 32


def merge_attn_reference_(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> None:
    lse = torch.logaddexp(lse_a, lse_b)
    w_a, w_b = ((x - lse).exp().t().unsqueeze(-1) for x in (lse_a, lse_b))  # [T, H, 1]
    o_a.copy_((o_a * w_a).addcmul_(o_b, w_b))  # (a bf16 output times float32 weights is float32)


if triton is not None:
    # token counts and the lse strides (= tokens) are not specialized on (divisible by 16, or 1): a job's batches
    # would each compile a variant on its clock, where the warm-up met only one
    @triton.jit(do_not_specialize=["T", "s_la", "s_lb"])
    def _merge_kernel(
        OA, LA, OB, LB, T, s_oat, s_oah, s_la, s_obt, s_obh, s_lb, D: tl.constexpr, BT: tl.constexpr
    ):  # fmt: skip
        """Tokens [BT) of block program_id(0), head program_id(1): OA = OA * wa + OB * wb."""
        h = tl.program_id(1)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        d = tl.arange(0, D)
        m = t < T
        la = tl.load(LA + h * s_la + t, mask=m, other=0.0)
        lb = tl.load(LB + h * s_lb + t, mask=m, other=0.0)
        top = tl.maximum(la, lb)
        wa, wb = tl.exp(la - top), tl.exp(lb - top)
        wa, wb = wa / (wa + wb), wb / (wa + wb)
        pa = OA + t[:, None] * s_oat + h * s_oah + d[None, :]
        a = tl.load(pa, mask=m[:, None], other=0.0).to(tl.float32)
        b = tl.load(OB + t[:, None] * s_obt + h * s_obh + d[None, :], mask=m[:, None], other=0.0).to(
            tl.float32
        )
        tl.store(pa, (a * wa[:, None] + b * wb[:, None]).to(OA.dtype.element_ty), mask=m[:, None])


def kernel_ok(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> bool:
    """Whether the kernel takes this call: CUDA bf16 / fp16 (or the interpreter), head_dim a power of two and
    contiguous, tokens contiguous in the log-sum-exps."""
    runs = (o_a.is_cuda and o_a.dtype in (torch.bfloat16, torch.float16)) or interpreting()
    d = o_a.shape[-1]
    return (
        triton is not None
        and runs
        and 16 <= d <= 256
        and not d & (d - 1)
        and o_a.stride(2) == o_b.stride(2) == 1
        and lse_a.stride(1) == lse_b.stride(1) == 1
    )


def merge_attn_(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> None:
    """o_a [T, H, D] becomes the attention over both key sets: o_a's and o_b's (same shape), lse [H, T] float32."""
    if not kernel_ok(o_a, lse_a, o_b, lse_b):
        return merge_attn_reference_(o_a, lse_a, o_b, lse_b)
    t, h, d = o_a.shape
    grid = (triton.cdiv(t, TOKENS_PER_PROGRAM), h)
    _merge_kernel[grid](o_a, lse_a, o_b, lse_b, t, o_a.stride(0), o_a.stride(1), lse_a.stride(0), o_b.stride(0),
                        o_b.stride(1), lse_b.stride(0), D=d, BT=TOKENS_PER_PROGRAM)  # fmt: skip
