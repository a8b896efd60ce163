"""Residual + layer scale + next norm in one pass: `x_new = x + ls * (y + bias)`, `h = norm(x_new)`.

The InternViT layer does this twice (after proj, after fc2). Inductor fuses it too, but on an H200 at 64 tiles its
kernel ran at 175-192 us per call for the 300M encoder (bench/RESULTS.md, session 6), against 114 us for the same
sums compiled alone, so here it is one Triton pass over whole rows (one or a few rows per program, `launch_config`):
read y and x once, write x_new and h once.

The same kernel's shift mode with no shift is the 6B's q/k RMSNorm (`qk_norm`): it reads the q and k columns of the
qkv rows where they lie (a row stride of 3C) and writes each normalized part once.

Registered with `torch.library` plus a fake implementation, so a compiled layer traces it as one opaque node; off
CUDA (or without Triton) the same op runs `residual_norm_reference`, the eager layer's sums.
Numerics: the norm reads x_new's fp32 sum, before it is rounded to the activation dtype for storage (as Inductor's
kernel does; the eager layer normalizes the rounded x_new). On an H200 that left the full-depth error near the eager
path's: 1.66e-2 (6B) / 1.28e-2 (300M) from fp32 against eager's 1.74e-2 / 1.30e-2 and 1.2e-2 / 9.7e-3 with Inductor's
own kernels (bench/RESULTS.md, sessions 6-7), so most of that difference lies elsewhere. RMSNorm multiplies its
weight after rounding the normalized row (`internvit.RMSNorm`). The CPU reference is the eager layer's sums.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from batchvl.encoder.internvit import rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the reference
    triton = None


def residual_norm_reference(
    x: Tensor, y: Tensor, bias: Tensor | None, ls: Tensor, w: Tensor, nb: Tensor | None, eps: float, rms: bool
) -> tuple[Tensor, Tensor]:
    """x, y [M, C]; bias, ls, w, nb [C] -> (x + ls * (y + bias), norm(that)), as the eager layer computes them."""
    x_new = x + ls * (y + bias if bias is not None else y)
    if rms:
        xf = x_new.float()
        h = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    else:
        h = F.layer_norm(x_new, (x.shape[-1],), w, nb, eps)
    return x_new, h


if triton is not None:

    @triton.jit
    def _residual_norm_kernel(
        X, Y, BIAS, LS, W, NB, XO, HO, M, C, stride_x, eps,
        HAS_BIAS: tl.constexpr, HAS_NB: tl.constexpr, RMS: tl.constexpr, BLOCK_C: tl.constexpr,
        SHIFT: tl.constexpr = False, ROWS: tl.constexpr = 1, HAS_Y: tl.constexpr = True,
    ):  # fmt: skip
        """ROWS rows per program; X's rows stride_x apart, the others' C. SHIFT: Y is one [C] vector added to every
        row (none without HAS_Y; no bias, no layer scale), and x + y is not stored."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        cols = tl.arange(0, BLOCK_C)
        mc = cols < C
        m = (rows < M)[:, None] & mc[None, :]  # [ROWS, BLOCK_C]
        off = rows[:, None] * C + cols[None, :]
        if SHIFT:
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_Y:
                x = x + tl.load(Y + cols, mask=mc, other=0.0)[None, :]
        else:
            y = tl.load(Y + off, mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(BIAS + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
            ls = tl.load(LS + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
            x = tl.load(X + off, mask=m, other=0.0).to(tl.float32) + ls * y
            # stored rounded; the norm below reads the fp32 sum, as Inductor's kernel does
            tl.store(XO + off, x.to(XO.dtype.element_ty), mask=m)
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
        tl.store(HO + off, h.to(HO.dtype.element_ty), mask=m)


MAX_TRITON_WIDTH = 8192  # one row per program in registers: InternViT's widths are 1024 and 3200


def _use_triton(x: Tensor) -> bool:
    return triton is not None and (x.is_cuda or triton_interpreting()) and x.shape[-1] <= MAX_TRITON_WIDTH


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@torch.library.custom_op("batchvl::residual_norm", mutates_args=())
def residual_norm(
    x: Tensor, y: Tensor, bias: Tensor | None, ls: Tensor, w: Tensor, nb: Tensor | None, eps: float, rms: bool
) -> tuple[Tensor, Tensor]:
    """x, y [M, C] (contiguous rows) -> (x + ls * (y + bias), norm(...)), norm = RMSNorm (rms) or LayerNorm."""
    if not _use_triton(x):
        return residual_norm_reference(x, y, bias, ls, w, nb, eps, rms)
    x, y = x.contiguous(), y.contiguous()
    xo, ho = torch.empty_like(x), torch.empty_like(x)
    _launch(x, y, bias, ls, w, nb, xo, ho, eps, rms, shift=False)
    return xo, ho


def launch_config(C: int, shift: bool = False) -> tuple[int, int]:
    """(rows per program, warps) of `_residual_norm_kernel` for rows of width C. Measured on an H200 over 65 600 rows
    (`bench/probe.py passes`, bench/RESULTS.md session 13): the residual mode runs best with one row per program and
    warps growing with the width (1024: 4 warps, 4087 GB/s; 3200: 16, 4198 GB/s); the shift mode, which moves half
    the bytes per row, with 4 warps and 2048 columns per program (1024: 2 rows, 3855 GB/s against 3463 with one;
    3200: 1 row, 4159 against 3567 with 16 warps)."""
    block = triton.next_power_of_2(C)
    if shift:
        return max(1, 2048 // block), 4
    return 1, min(16, max(4, block // 256))


def _launch(
    x: Tensor, y: Tensor, bias, ls, w: Tensor, nb, xo: Tensor, ho: Tensor, eps: float, rms: bool, shift: bool,
    cfg: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """`_residual_norm_kernel` over x [M, C] (cfg: (rows per program, warps); default `launch_config(C, shift)`).
    x's rows may be any stride apart in shift mode (columns contiguous); y None there: no shift."""
    M, C = x.shape
    rows, warps = cfg or launch_config(C, shift)
    _residual_norm_kernel[(triton.cdiv(M, rows),)](
        x, y if y is not None else x, bias if bias is not None else x, ls if ls is not None else x, w,
        nb if nb is not None else w, xo, ho, M, C, x.stride(0), eps, HAS_BIAS=bias is not None, HAS_NB=nb is not None,
        RMS=rms, BLOCK_C=triton.next_power_of_2(C), SHIFT=shift, ROWS=rows, HAS_Y=y is not None, num_warps=warps,
    )  # fmt: skip


@residual_norm.register_fake
def _(x, y, bias, ls, w, nb, eps, rms):
    return torch.empty_like(x), torch.empty_like(x)


def shifted_norm_reference(
    x: Tensor, shift: Tensor, w: Tensor, nb: Tensor | None, eps: float, rms: bool
) -> Tensor:
    """x [M, C], shift [C] fp32 -> norm(x + shift), the sum kept in fp32 (as `residual_norm`'s norm reads it)."""
    xf = x.float() + shift
    if rms:
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return F.layer_norm(xf, (x.shape[-1],), w.float(), nb.float() if nb is not None else None, eps).to(
        x.dtype
    )


@torch.library.custom_op("batchvl::shifted_norm", mutates_args=())
def shifted_norm(x: Tensor, shift: Tensor, w: Tensor, nb: Tensor | None, eps: float, rms: bool) -> Tensor:
    """x [M, C] (contiguous rows), shift [C] fp32 -> norm(x + shift): one read of x, one write of the result."""
    if not _use_triton(x):
        return shifted_norm_reference(x, shift, w, nb, eps, rms)
    x = x.contiguous()
    ho = torch.empty_like(x)
    _launch(x, shift, None, None, w, nb, x, ho, eps, rms, shift=True)
    return ho


@shifted_norm.register_fake
def _(x, shift, w, nb, eps, rms):
    return torch.empty_like(x)


def qk_norm_reference(qkv: Tensor, wq: Tensor, wk: Tensor, eps: float) -> Tensor:
    """qkv [M, 3C] (q | k | v columns) -> [2, M, C]: the q and k columns each RMS-normalized over the full C, as
    `internvit.rms_norm` computes them (fp32 sums, rounded, then times the weight)."""
    C = qkv.shape[1] // 3
    return torch.stack([rms_norm(qkv[:, i * C : (i + 1) * C], w, eps) for i, w in enumerate((wq, wk))])


@torch.library.custom_op("batchvl::qk_norm", mutates_args=())
def qk_norm(qkv: Tensor, wq: Tensor, wk: Tensor, eps: float) -> Tensor:
    """`qk_norm_reference` as one shift-mode pass per part reading the qkv rows where they lie: one read of q and
    k, one write of each (Inductor's reduction over 3200 columns is not persistent and reads each row twice)."""
    M, C = qkv.shape[0], qkv.shape[1] // 3
    if not _use_triton(qkv[:, :C]):
        return qk_norm_reference(qkv, wq, wk, eps)
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    out = qkv.new_empty(2, M, C)
    for i, w in enumerate((wq, wk)):
        part = qkv[:, i * C : (i + 1) * C]
        _launch(part, None, None, None, w, None, part, out[i], eps, True, shift=True)
    return out


@qk_norm.register_fake
def _(qkv, wq, wk, eps):
    return qkv.new_empty(2, qkv.shape[0], qkv.shape[1] // 3)


@torch.library.custom_op("batchvl::addmm_into", mutates_args=("x",))
def addmm_into(x: Tensor, a: Tensor, w: Tensor) -> None:
    """x += a @ w^T in place: cuBLAS reads x as its C and writes the result over it (no copy of x first, which
    out-of-place addmm makes). x [M, N], a [M, K], w [N, K]."""
    x.addmm_(a, w.t())


@addmm_into.register_fake
def _(x, a, w):
    return None


def norm_params(norm: torch.nn.Module) -> tuple[Tensor, Tensor | None, float, bool]:
    """(weight, bias or None, eps, is_rms) of an InternViT norm (LayerNorm or internvit.RMSNorm)."""
    if isinstance(norm, torch.nn.LayerNorm):
        return norm.weight, norm.bias, norm.eps, False
    return norm.weight, None, norm.eps, True
