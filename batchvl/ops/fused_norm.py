"""Norm passes of the compiled InternViT, each one Triton pass over whole rows, beside its eager reference.

- `shifted_norm(x, shift, ...)`: norm(x + shift) for the in-place residual stream (`fast_layer_inplace`), where the
  proj / fc2 biases wait in a [C] fp32 shift instead of being added to x; one read of x, one write.
- `qk_norm(qkv, wq, wk, eps)`: the 6B's full-width q / k RMSNorm, reading the q and k columns of the qkv rows where
  they lie (Inductor's reduction over 3200 columns reads each row twice).
- `addmm_into(x, a, w)`: x += a @ w^T with cuBLAS writing over x (no copy of x first).

Each is registered with `torch.library` plus a fake implementation, so a compiled layer traces it as one node; off
CUDA (or without Triton) it runs its reference. The norm reads the fp32 sum x + shift before any rounding, as
Inductor's fused kernel does; RMSNorm multiplies its weight after rounding the normalized row (`ops.norm.rms_norm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from batchvl.ops.norm import rms_norm
from batchvl.ops.triton_support import tl, triton, triton_runs_on

MAX_TRITON_WIDTH = 8192  # a row per program in registers: InternViT's widths are 1024 and 3200

if triton is not None:

    @triton.jit(do_not_specialize=["M"])  # rows (tiles x 1025) vary by batch: one compiled variant for all
    def _norm_kernel(
        X,
        SHIFT,
        W,
        NB,
        HO,
        M,
        C,
        stride_x,
        eps,
        HAS_SHIFT: tl.constexpr,
        HAS_NB: tl.constexpr,
        RMS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        """ROWS rows per program: HO = norm(X + SHIFT); X's rows stride_x apart, HO's C."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        cols = tl.arange(0, BLOCK_C)
        mc = cols < C
        m = (rows < M)[:, None] & mc[None, :]  # [ROWS, BLOCK_C]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_SHIFT:
            x = x + tl.load(SHIFT + cols, mask=mc, other=0.0)[None, :]
        w = tl.load(W + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
        if RMS:
            n = x * tl.rsqrt(tl.sum(x * x, axis=1) / C + eps)[:, None]
            h = n.to(HO.dtype.element_ty).to(tl.float32) * w
        else:
            mean = tl.sum(x, axis=1) / C
            d = tl.where(m, x - mean[:, None], 0.0)
            h = d * tl.rsqrt(tl.sum(d * d, axis=1) / C + eps)[:, None] * w
            if HAS_NB:
                h = h + tl.load(NB + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
        tl.store(HO + rows[:, None] * C + cols[None, :], h.to(HO.dtype.element_ty), mask=m)


def _use_triton(x: Tensor) -> bool:
    return triton_runs_on(x) and x.shape[-1] <= MAX_TRITON_WIDTH


def launch_config(C: int) -> tuple[int, int]:
    """(rows per program, warps) for rows of width C: 2048 columns per program, 4 warps (measured best)."""
    return max(1, 2048 // triton.next_power_of_2(C)), 4


def _launch(
    x: Tensor, shift: Tensor | None, w: Tensor, nb: Tensor | None, ho: Tensor, eps: float, rms: bool
) -> None:
    """`_norm_kernel` over x [M, C] (rows any stride apart, columns contiguous) into ho [M, C]."""
    M, C = x.shape
    rows, warps = launch_config(C)
    _norm_kernel[(triton.cdiv(M, rows),)](
        x,
        shift if shift is not None else x,
        w,
        nb if nb is not None else w,
        ho,
        M,
        C,
        x.stride(0),
        eps,
        HAS_SHIFT=shift is not None,
        HAS_NB=nb is not None,
        RMS=rms,
        BLOCK_C=triton.next_power_of_2(C),
        ROWS=rows,
        num_warps=warps,
    )


def shifted_norm_reference(
    x: Tensor, shift: Tensor, w: Tensor, nb: Tensor | None, eps: float, rms: bool
) -> Tensor:
    """x [M, C], shift [C] fp32 -> norm(x + shift), the sum kept in fp32."""
    xf = x.float() + shift
    if rms:
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    nbf = nb.float() if nb is not None else None
    return F.layer_norm(xf, (x.shape[-1],), w.float(), nbf, eps).to(x.dtype)


@torch.library.custom_op("batchvl::shifted_norm", mutates_args=())
def shifted_norm(x: Tensor, shift: Tensor, w: Tensor, nb: Tensor | None, eps: float, rms: bool) -> Tensor:
    """x [M, C] (contiguous rows), shift [C] fp32 -> norm(x + shift), RMSNorm (rms) or LayerNorm."""
    if not _use_triton(x):
        return shifted_norm_reference(x, shift, w, nb, eps, rms)
    x = x.contiguous()
    ho = torch.empty_like(x)
    _launch(x, shift, w, nb, ho, eps, rms)
    return ho


@shifted_norm.register_fake
def _(x, shift, w, nb, eps, rms):
    return torch.empty_like(x)


def qk_norm_reference(qkv: Tensor, wq: Tensor, wk: Tensor, eps: float) -> Tensor:
    """qkv [M, 3C] (q | k | v columns) -> [2, M, C]: q and k each RMS-normalized over the full C."""
    C = qkv.shape[1] // 3
    return torch.stack([rms_norm(qkv[:, i * C : (i + 1) * C], w, eps) for i, w in enumerate((wq, wk))])


@torch.library.custom_op("batchvl::qk_norm", mutates_args=())
def qk_norm(qkv: Tensor, wq: Tensor, wk: Tensor, eps: float) -> Tensor:
    """`qk_norm_reference` as one pass per part over the qkv rows where they lie."""
    M, C = qkv.shape[0], qkv.shape[1] // 3
    if not _use_triton(qkv[:, :C]):
        return qk_norm_reference(qkv, wq, wk, eps)
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    out = qkv.new_empty(2, M, C)
    for i, w in enumerate((wq, wk)):
        _launch(qkv[:, i * C : (i + 1) * C], None, w, None, out[i], eps, True)
    return out


@qk_norm.register_fake
def _(qkv, wq, wk, eps):
    return qkv.new_empty(2, qkv.shape[0], qkv.shape[1] // 3)


@torch.library.custom_op("batchvl::addmm_into", mutates_args=("x",))
def addmm_into(x: Tensor, a: Tensor, w: Tensor) -> None:
    """x += a @ w^T in place (x [M, N], a [M, K], w [N, K]): cuBLAS reads x as its C and writes over it."""
    x.addmm_(a, w.t())


@addmm_into.register_fake
def _(x, a, w):
    return None


def norm_params(norm: torch.nn.Module) -> tuple[Tensor, Tensor | None, float, bool]:
    """(weight, bias or None, eps, is_rms) of an InternViT norm (LayerNorm or RMSNorm)."""
    if isinstance(norm, torch.nn.LayerNorm):
        return norm.weight, norm.bias, norm.eps, False
    return norm.weight, None, norm.eps, True
