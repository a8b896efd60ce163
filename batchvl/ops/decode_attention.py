"""Decode attention: one new token per cache row against that row's valid keys, `decode_attention(q, k, v, lens)`.

The reference (`decode_attention_reference`) is one masked SDPA call over the whole padded cache: it reads every
padded slot and runs one program per (row, kv head), too few to fill the GPU.

The Triton path splits each row's keys into chunks (flash-decoding): a program per (row, kv head, chunk) scores the
`rep` query heads that share the kv head (GQA, padded to 16 rows for the tensor cores) against the chunk's valid
keys only and writes a partial (max, sum, output); a second kernel merges a head's partials. Slots at or past
`lens[row]` are never read, so padded rows and lengths cost nothing but their programs' launch.

Registered with `torch.library` plus a fake implementation, so a compiled layer traces it as one node, and it makes
no host syncs (the lengths stay on the device), so a CUDA graph captures it. The kernel runs on CUDA for bf16 / fp16
(and under Triton's interpreter); elsewhere the op runs the reference. Numerics as in any flash kernel: scores and
sums in fp32, the probabilities rounded to the value dtype for the second product.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from batchvl.ops.triton_support import interpreting, tl, triton


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor) -> Tensor:
    """q [B, H, D] against cache rows [B, Hkv, S, D], keys < kv_lens[b] valid -> [B, H, D].
    GQA without copying the cache: the `rep` query heads of one kv head become that head's query rows, so SDPA
    sees [B, Hkv, rep, D] queries and plain (non-GQA) keys, and a [B, 1, 1, S] mask picks the valid ones. On CUDA
    that takes a fused kernel that keeps the scores in fp32 (SDPA with GQA and a mask falls back to its math path,
    and bf16 batched GEMMs round the scores to bf16, which was measured to flip greedy tokens)."""
    b, h, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    qg = q.view(b, hkv, h // hkv, d)  # [B, Hkv, rep, D]
    valid = torch.arange(s, device=q.device)[None, :] < kv_lens[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(
        qg, k_cache, v_cache, attn_mask=valid[:, None, None, :]
    )  # [B, Hkv, rep, D]
    return out.reshape(b, h, d)


INTERPRET = interpreting()
BLOCK_N = 64  # keys per step of a program's loop
# split the keys until (rows x kv heads x chunks) reaches this many programs (an H200 has 132 SMs)
MIN_PROGRAMS = 1024

if triton is not None:

    @triton.jit
    def _decode_partial_kernel(
        Q,
        K,
        V,
        LENS,
        PM,
        PL,
        PA,
        S,
        CHUNK,
        qk_scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_vb,
        stride_vh,
        stride_vs,
        REP: tl.constexpr,
        REP_P: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One (row, kv head, chunk): its REP query heads against keys [chunk * CHUNK, +CHUNK) below LENS[row] (and S).
        Partials PM / PL [B, H, NS] and PA [B, H, NS, D] (fp32); an empty chunk writes max -inf, sum 0."""
        b, hk, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ns, hkv = tl.num_programs(2), tl.num_programs(1)
        r = tl.arange(0, REP_P)  # [REP_P] query heads of this kv head (REP of them real)
        d = tl.arange(0, D)
        rmask = r < REP
        heads = hk * REP + r
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=rmask[:, None], other=0.0
        )
        n_valid = tl.minimum(tl.load(LENS + b).to(tl.int32), S)  # never past the cache row
        start = sp * CHUNK
        end = tl.minimum(start + CHUNK, n_valid)
        m_i = tl.zeros([REP_P], tl.float32) - float("inf")
        l_i = tl.zeros([REP_P], tl.float32)
        acc = tl.zeros([REP_P, D], tl.float32)
        kb = K + b.to(tl.int64) * stride_kb + hk * stride_kh
        vb = V + b.to(tl.int64) * stride_vb + hk * stride_vh
        for n in tl.range(start, end, BLOCK_N):
            cols = n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key slots
            kmask = cols < end
            k = tl.load(kb + cols[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [REP_P, BLOCK_N] fp32, log2 units
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vb + cols[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        part = (b * hkv * REP + heads) * ns + sp  # [REP_P]
        tl.store(PM + part, m_i, mask=rmask)
        tl.store(PL + part, l_i, mask=rmask)
        tl.store(PA + part[:, None] * D + d[None, :], acc, mask=rmask[:, None])

    @triton.jit
    def _decode_merge_kernel(PM, PL, PA, OUT, NS: tl.constexpr, NS_P: tl.constexpr, D: tl.constexpr):
        """One program per (row, head): its output from the NS chunks' partials (at least one chunk is non-empty)."""
        bh = tl.program_id(0)
        i = tl.arange(0, NS_P)
        d = tl.arange(0, D)
        imask = i < NS
        m = tl.load(PM + bh * NS + i, mask=imask, other=float("-inf"))  # [NS_P]
        w = tl.math.exp2(m - tl.max(m, axis=0))  # empty chunks: 0
        l = tl.sum(tl.load(PL + bh * NS + i, mask=imask, other=0.0) * w, axis=0)  # noqa: E741
        a = tl.load(PA + (bh * NS + i)[:, None] * D + d[None, :], mask=imask[:, None], other=0.0)  # [NS_P, D]
        tl.store(OUT + bh * D + d, (tl.sum(a * w[:, None], axis=0) / l).to(OUT.dtype.element_ty))


def kernel_runs(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the Triton path takes these shapes: CUDA bf16 / fp16 (or the interpreter), head_dim a power of two in
    16..256, at most 16 query heads per kv head."""
    if triton is None or not (
        (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)) or INTERPRET
    ):
        return False
    return (
        16 <= head_dim <= 256
        and not head_dim & (head_dim - 1)
        and not heads % kv_heads
        and heads // kv_heads <= 16
    )


def kernel_ok(q: Tensor, k_cache: Tensor) -> bool:
    """`kernel_runs` for this call, with the head_dim contiguous in the cache."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.stride(3) != 1:
        return False
    return kernel_runs(q.device, q.dtype, q.shape[1], k_cache.shape[1], q.shape[2])


def num_chunks(rows: int, kv_heads: int, max_len: int, block_n: int = BLOCK_N) -> int:
    """Chunks per (row, kv head): enough programs to fill the GPU, each chunk at least one BLOCK_N."""
    want = -(-MIN_PROGRAMS // max(rows * kv_heads, 1))
    return max(1, min(want, -(-max_len // block_n)))


def _decode_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_lens: Tensor,
    block_n: int = BLOCK_N,
    chunks: int | None = None,
) -> Tensor:
    B, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    rep = H // Hkv
    ns = chunks or num_chunks(B, Hkv, S, block_n)
    chunk = -(-S // ns)
    chunk = -(-chunk // block_n) * block_n
    q = q if q.stride(2) == 1 else q.contiguous()
    v_cache = v_cache if v_cache.stride(3) == 1 else v_cache.contiguous()
    pm = torch.empty(B, H, ns, device=q.device, dtype=torch.float32)
    pl, pa = torch.empty_like(pm), torch.empty(B, H, ns, D, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    _decode_partial_kernel[(B, Hkv, ns)](
        q,
        k_cache,
        v_cache,
        kv_lens,
        pm,
        pl,
        pa,
        S,
        chunk,
        D**-0.5 * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        REP=rep,
        REP_P=max(16, triton.next_power_of_2(rep)),
        D=D,
        BLOCK_N=block_n,
        num_warps=4,
        num_stages=3,
    )
    _decode_merge_kernel[(B * H,)](pm, pl, pa, out, NS=ns, NS_P=triton.next_power_of_2(ns), D=D)
    return out


@torch.library.custom_op("batchvl::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor) -> Tensor:
    """q [B, H, D] (one token per cache row) against k_cache / v_cache [B, Hkv, S, D], slots < kv_lens[b] valid
    (kv_lens [B] integer, each >= 1) -> [B, H, D]."""
    if kernel_ok(q, k_cache):
        return _decode_attention_triton(q, k_cache, v_cache, kv_lens)
    return decode_attention_reference(q, k_cache, v_cache, kv_lens)


@decode_attention.register_fake
def _(q, k_cache, v_cache, kv_lens):
    return q.new_empty(q.shape)  # contiguous, as the kernel and the reference return it
