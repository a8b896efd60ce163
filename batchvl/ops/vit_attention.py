"""InternViT self-attention as one Triton kernel that knows the CLS token: `vit_attention(qkv, ...)`.

A tile is T = 1 + 1024 tokens (a CLS token, then 32 x 32 patches). SDPA kernels tile the keys in blocks of 64-128, so
the 1025th key costs a whole block. Here the CLS key is inside the kernel:

- each program takes BLOCK_M patch queries of one (tile, head), starts its online softmax from the CLS key (a rank-
  one step on CUDA cores), then runs the 1024 patch keys in full blocks, with no masking;
- the CLS query is split over the same programs: each scores it against its own patch keys and writes a partial
  (max, sum, output); a small kernel merges the partials;
- a full-width q/k RMSNorm (the 6B's) can be folded in: q is multiplied by rstd_q * (w_q * w_k) once per program and
  each score by the key's rstd_k; the normalized q and k are never written.

Registered with `torch.library` plus a fake implementation, so a compiled layer traces it as one node. The kernel runs
on CUDA for bf16 / fp16 where `CONFIGS` has the head_dim (only 64, the 300M: at 128 it lost to cuDNN); elsewhere
`vit_attention_reference`, the eager layer's sums. `vit_attention_sdpa` is the path without a config: the q/k norm as
one Triton pass (`fused_norm.qk_norm`), then SDPA.
Numerics: q * rstd_q * (w_q * w_k) is rounded once to the activation dtype; the scores are fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from batchvl.ops.fused_norm import qk_norm
from batchvl.ops.norm import rms_norm
from batchvl.ops.triton_support import interpreting, tl, triton


def vit_attention_reference(
    qkv: Tensor, T: int, H: int, scale: float, wq: Tensor | None, wk: Tensor | None, eps: float
) -> Tensor:
    """qkv [B*T, 3C] (q | k | v columns) -> heads' outputs [B*T, C], as `InternViTAttention.mix` computes them.
    Kept beside `mix` rather than shared: `mix` calls its norm modules (TP swaps in sharded ones), this takes weights."""
    M, C3 = qkv.shape
    q, k, v = qkv.reshape(M // T, T, C3).chunk(3, dim=-1)  # 3 x [B, T, C]
    if wq is not None:
        q, k = rms_norm(q, wq, eps), rms_norm(k, wk, eps)
    return sdpa_heads(q, k, v, H, scale)


def vit_attention_sdpa(
    qkv: Tensor, T: int, H: int, scale: float, wq: Tensor | None, wk: Tensor | None, eps: float
) -> Tensor:
    """`vit_attention_reference` with the q/k RMSNorm as `fused_norm.qk_norm` (one Triton pass per part on CUDA,
    the reference's sums elsewhere), then SDPA: the path where `vit_attention` has no config (the 6B)."""
    if wq is None:
        return vit_attention_reference(qkv, T, H, scale, wq, wk, eps)
    M, C3 = qkv.shape
    q, k = qk_norm(qkv, wq, wk, eps).view(2, M // T, T, C3 // 3)  # 2 x [B, T, C]
    return sdpa_heads(q, k, qkv.reshape(M // T, T, C3)[..., 2 * C3 // 3 :], H, scale)


def sdpa_heads(q: Tensor, k: Tensor, v: Tensor, H: int, scale: float) -> Tensor:
    """q, k, v [B, T, C] (any row strides) -> SDPA over H heads -> [B*T, C]."""
    B, T, C = q.shape
    q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    o = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [B, H, T, D]
    return o.transpose(1, 2).reshape(B * T, C)


INTERPRET = interpreting()  # read once: `kernel_config` also runs while Dynamo traces
# (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA loads) per head_dim where the kernel beats cuDNN (bench/history/)
# (Triton 3.6 gave wrong output at head_dim 128 with TMA boxes of 128 x 128: never use those)
CONFIGS = {64: (128, 128, 4, 3, True)}
MAX_GRID_Y = 65535  # the grid is (query blocks, tiles * heads): the blocks of one head run side by side

if triton is not None:

    @triton.jit
    def _cls_partial(
        k, v, RKS, PM, PL, PA, krows, q0, k0, v0, ks0, qk_scale, d, part, first, NORM: tl.constexpr,
        D: tl.constexpr,
    ):  # fmt: skip
        """The CLS query against one program's patch keys k, v [BLOCK, D] (rows krows; program 0: and the CLS key):
        its partial (max, sum, output) for `_cls_merge_kernel`."""
        s0 = tl.sum(k.to(tl.float32) * q0[None, :], axis=1)  # [BLOCK]
        s0 = s0 * (tl.load(RKS + krows) if NORM else qk_scale)
        s00 = tl.where(first, tl.sum(q0 * k0, axis=0) * ks0, float("-inf"))
        mp = tl.maximum(tl.max(s0, axis=0), s00)
        p0 = tl.math.exp2(s0 - mp)
        e00 = tl.math.exp2(s00 - mp)
        tl.store(PM + part, mp)
        tl.store(PL + part, tl.sum(p0, axis=0) + e00)
        tl.store(PA + part * D + d, tl.sum(p0[:, None] * v.to(tl.float32), axis=0) + e00 * v0)

    @triton.jit
    def _attend_block(q, k, v, m_i, l_i, acc, RKS, krows, qk_scale, NORM: tl.constexpr):
        """Patch keys k, v [BLOCK_N, D] (rows krows) into the online softmax (m_i, l_i, acc) of q [BLOCK_M, D]."""
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32
        if NORM:
            s = s * tl.load(RKS + krows)[None, :]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
        else:  # one FMA per score
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return m_new, l_i, acc

    @triton.jit
    def _load_kv(
        QKV, KDESC, base, base32, j, kcol, vcol, kc0, vc0, stride_row, BLOCK_N: tl.constexpr,
        TMA: tl.constexpr,
    ):  # fmt: skip
        """Patch keys j .. j + BLOCK_N - 1 of one (tile, head): k, v [BLOCK_N, D] and their rows [BLOCK_N].
        kc0, vc0: the head's first k / v column (the TMA boxes' column coordinates)."""
        krows = base + 1 + j + tl.arange(0, BLOCK_N)
        if TMA:
            k = KDESC.load([base32 + 1 + j, kc0])
            v = KDESC.load([base32 + 1 + j, vc0])
        else:
            k = tl.load(QKV + krows[:, None] * stride_row + kcol[None, :])
            v = tl.load(QKV + krows[:, None] * stride_row + vcol[None, :])
        return k, v, krows

    @triton.jit
    def _vit_attn_kernel(
        QKV, OUT, RQ, RKS, G, PM, PL, PA, T, H, C, stride_row, qk_scale, QDESC, KDESC,
        NORM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
    ):  # fmt: skip
        """RQ: rstd_q per row; RKS: rstd_k * scale * log2(e) per row; G: w_q * w_k (all fp32; NORM only).
        TMA: q, k, v tiles loaded through the tensor descriptors QDESC ([BLOCK_M, D] boxes) and KDESC ([BLOCK_N, D])
        over the qkv rows."""
        pid_m = tl.program_id(0)  # which BLOCK_M patch queries (and patch keys, for the CLS query's partial)
        bh = tl.program_id(1)
        nq = tl.num_programs(0)
        b, h = bh // H, bh % H
        base32 = b * T  # the tile's CLS row (int32 for the descriptors' coordinates)
        base = base32.to(tl.int64)
        d = tl.arange(0, D)
        qcol, kcol, vcol = h * D + d, C + h * D + d, 2 * C + h * D + d  # [D] columns of q, k, v
        rows = base + 1 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] this program's patch rows
        if TMA:
            q = QDESC.load([base32 + 1 + pid_m * BLOCK_M, h * D])  # [BLOCK_M, D]
        else:
            q = tl.load(QKV + rows[:, None] * stride_row + qcol[None, :])  # [BLOCK_M, D]
        q0 = tl.load(QKV + base * stride_row + qcol).to(tl.float32)  # [D] the CLS query
        k0 = tl.load(QKV + base * stride_row + kcol).to(tl.float32)  # [D] the CLS key
        v0 = tl.load(QKV + base * stride_row + vcol).to(tl.float32)  # [D]
        if NORM:  # q normalized and weighted (w_q * w_k), rounded once; the key side scales the scores
            g = tl.load(G + qcol)  # [D] fp32
            q = (q.to(tl.float32) * g[None, :] * tl.load(RQ + rows)[:, None]).to(QKV.dtype.element_ty)
            q0 = q0 * g * tl.load(RQ + base)
            ks0 = tl.load(RKS + base)  # rstd_k * scale * log2(e) of the CLS key
        else:
            ks0 = qk_scale
        # the CLS key first, a rank-one step: the running max is its score, the sum 1, the output v_cls
        m_i = tl.sum(q.to(tl.float32) * k0[None, :], axis=1) * ks0  # [BLOCK_M]
        l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
        acc = tl.zeros([BLOCK_M, D], tl.float32) + v0[None, :]
        kc0, vc0 = C + h * D, 2 * C + h * D
        for j in tl.range(0, T - 1, BLOCK_N):  # the patch keys, full blocks
            k, v, krows = _load_kv(
                QKV, KDESC, base, base32, j, kcol, vcol, kc0, vc0, stride_row, BLOCK_N, TMA
            )
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, RKS, krows, qk_scale, NORM)
        # the CLS query's partial over this program's rows as keys
        k = tl.load(QKV + rows[:, None] * stride_row + kcol[None, :])  # [BLOCK_M, D]
        v = tl.load(QKV + rows[:, None] * stride_row + vcol[None, :])
        part = bh * nq + pid_m
        _cls_partial(k, v, RKS, PM, PL, PA, rows, q0, k0, v0, ks0, qk_scale, d, part, pid_m == 0, NORM, D)
        tl.store(OUT + rows[:, None] * C + qcol[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty))

    @triton.jit
    def _cls_merge_kernel(PM, PL, PA, OUT, T, H, C, NQ: tl.constexpr, D: tl.constexpr):
        """One program per (tile, head): the CLS query's output from its NQ partials."""
        bh = tl.program_id(0)
        b, h = bh // H, bh % H
        i = tl.arange(0, NQ)
        d = tl.arange(0, D)
        m = tl.load(PM + bh * NQ + i)  # [NQ]
        w = tl.math.exp2(m - tl.max(m, axis=0))
        l = tl.sum(tl.load(PL + bh * NQ + i) * w, axis=0)  # noqa: E741
        a = tl.load(PA + (bh * NQ + i)[:, None] * D + d[None, :])  # [NQ, D]
        o = tl.sum(a * w[:, None], axis=0) / l
        tl.store(OUT + (b * T).to(tl.int64) * C + h * D + d, o.to(OUT.dtype.element_ty))


def kernel_config(qkv: Tensor, T: int, H: int) -> tuple | None:
    """The kernel's `CONFIGS` entry for this call, or None where the reference runs (CPU unless interpreting,
    fp32, a head_dim without an entry, T - 1 not a power-of-two count of BLOCK_M blocks, more (tile, head) pairs than
    a CUDA grid's second dimension takes)."""
    if triton is None or qkv.dim() != 2 or qkv.shape[1] % (3 * H) or (qkv.shape[0] // T) * H > MAX_GRID_Y:
        return None
    if not ((qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16)) or INTERPRET):
        return None
    cfg = CONFIGS.get(qkv.shape[1] // (3 * H))
    if (
        cfg is None
        or T < 2
        or (T - 1) % cfg[0]
        or (T - 1) % cfg[1]
        or ((T - 1) // cfg[0]) & ((T - 1) // cfg[0] - 1)
    ):
        return None  # the CLS partials' count must be a power of two
    return cfg


@torch.library.custom_op("batchvl::vit_attention", mutates_args=())
def vit_attention(
    qkv: Tensor, T: int, H: int, scale: float, wq: Tensor | None, wk: Tensor | None, eps: float
) -> Tensor:
    """qkv [B*T, 3C] (the fused projection's rows: q | k | v, T = 1 CLS + patches per tile) -> [B*T, C].
    wq, wk: the q/k RMSNorm weights over the full C (None: no qk-norm)."""
    cfg = kernel_config(qkv, T, H)
    if cfg is None:
        return vit_attention_reference(qkv, T, H, scale, wq, wk, eps)
    return _vit_attention_triton(qkv, T, H, scale, wq, wk, eps, cfg)


@vit_attention.register_fake
def _(qkv, T, H, scale, wq, wk, eps):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)


def _vit_attention_triton(
    qkv: Tensor,
    T: int,
    H: int,
    scale: float,
    wq: Tensor | None,
    wk: Tensor | None,
    eps: float,
    cfg: tuple,
) -> Tensor:
    """cfg: (BLOCK_M, BLOCK_N, warps, stages[, TMA loads])."""
    block_m, block_n, warps, stages = cfg[:4]
    tma = len(cfg) > 4 and cfg[4]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    tma = tma and qkv.data_ptr() % 16 == 0 and qkv.stride(0) * qkv.element_size() % 16 == 0  # TMA's alignment
    M, C3 = qkv.shape
    C, B = C3 // 3, M // T
    D, nq = C // H, (T - 1) // block_m
    o = qkv.new_empty(M, C)
    norm = wq is not None
    if norm:  # per-row 1 / rms over the full C, read straight from the bf16 rows (fp32 sums)
        rq, rk = (
            torch.rsqrt(torch.linalg.vector_norm(t, dim=-1, dtype=torch.float32).square() / C + eps)
            for t in (qkv[:, :C], qkv[:, C : 2 * C])
        )
        rk = rk * (scale * math.log2(math.e))
        g = wq.float() * wk.float()
    else:
        rq = rk = g = o  # unused
    pm = torch.empty(B * H, nq, device=qkv.device, dtype=torch.float32)
    pl, pa = torch.empty_like(pm), torch.empty(B * H, nq, D, device=qkv.device, dtype=torch.float32)
    qd = kd = qkv
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        qd, kd = (TensorDescriptor.from_tensor(qkv, [b_, D]) for b_ in (block_m, block_n))
    _vit_attn_kernel[(nq, B * H)](
        qkv, o, rq, rk, g, pm, pl, pa, T, H, C, qkv.stride(0), scale * math.log2(math.e), qd, kd,
        NORM=norm, D=D, BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _cls_merge_kernel[(B * H,)](pm, pl, pa, o, T, H, C, NQ=nq, D=D)
    return o
