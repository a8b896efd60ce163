"""Decode attention over the paged KV pool: one new token per sequence against that sequence's valid keys,
`decode_attention(q, k_pool, v_pool, kv_lens, block_table)`.

A sequence's keys live in the pool's blocks of `BLOCK` slots, listed in its row of `block_table`; position p sits in
block `block_table[b, p // BLOCK]` at slot `p % BLOCK`. The reference (`decode_attention_reference`) gathers each
sequence's blocks into a dense row and runs one masked SDPA call. The Triton path splits each sequence's keys into
chunks (flash-decoding): a program per (sequence, kv head, chunk) scores the `rep` query heads that share the kv head
(GQA, padded to 16 rows for the tensor cores) against the chunk's valid keys, one block per step, and writes a
partial (max, sum, output); a second kernel merges a head's partials. Slots at or past `kv_lens[b]` are never read.

Registered with `torch.library` plus a fake implementation, so a compiled layer traces it as one node, and it makes no
host syncs, so a CUDA graph captures it. The kernel runs on CUDA for bf16 / fp16 (and under Triton's interpreter);
elsewhere the op runs the reference. Numerics as in any flash kernel: scores and sums in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from batchvl.ops.triton_support import interpreting, tl, triton

BLOCK = 64  # KV slots per pool block; also the kernel's keys per step


def gather_blocks(pool: Tensor, block_table: Tensor) -> Tensor:
    """pool [N, Hkv, BLOCK, D], block_table [B, W] -> each sequence's slots as one dense row [B, Hkv, W * BLOCK, D]."""
    b, w = block_table.shape
    rows = pool[block_table.long()]  # [B, W, Hkv, BLOCK, D]
    return rows.permute(0, 2, 1, 3, 4).reshape(b, pool.shape[1], w * pool.shape[2], pool.shape[3])


def decode_attention_reference(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_lens: Tensor, block_table: Tensor
) -> Tensor:
    """q [B, H, D] against each sequence's pool slots < kv_lens[b] -> [B, H, D]. GQA without copying the keys: the
    `rep` query heads of one kv head become that head's query rows, so SDPA sees [B, Hkv, rep, D] queries, plain keys
    and a [B, 1, 1, S] mask (on CUDA a fused kernel that keeps the scores in fp32: bf16 scores flip greedy tokens)."""
    b, h, d = q.shape
    k, v = gather_blocks(k_pool, block_table), gather_blocks(v_pool, block_table)  # [B, Hkv, S, D]
    hkv, s = k.shape[1], k.shape[2]
    qg = q.view(b, hkv, h // hkv, d)  # [B, Hkv, rep, D]
    valid = torch.arange(s, device=q.device)[None, :] < kv_lens[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None, :])  # [B, Hkv, rep, D]
    return out.reshape(b, h, d)


INTERPRET = interpreting()
# split the keys until (rows x kv heads x chunks) reaches this many programs (an H200 has 132 SMs)
MIN_PROGRAMS = 1024

if triton is not None:

    @triton.jit
    def _decode_partial_kernel(
        Q, K, V, LENS, BT, PM, PL, PA, S, qk_scale, stride_qb, stride_qh, stride_bt, stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, kv head, chunk): its REP query heads against its share of the keys below LENS[b] (and S),
        block by block through the sequence's row of BT. Partials PM / PL [B, H, NS] and PA [B, H, NS, D] (fp32);
        an empty chunk writes max -inf, sum 0."""
        b, hk, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ns, hkv = tl.num_programs(2), tl.num_programs(1)
        r = tl.arange(0, REP_P)  # [REP_P] query heads of this kv head (REP of them real)
        d = tl.arange(0, D)
        rmask = r < REP
        heads = hk * REP + r
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=rmask[:, None], other=0.0
        )
        n_valid = tl.minimum(tl.load(LENS + b).to(tl.int32), S)  # never past the table's row
        # this sequence's keys split evenly over the NS chunks, in whole blocks
        chunk = tl.cdiv(tl.cdiv(n_valid, ns), BLOCK_N) * BLOCK_N
        start = sp * chunk
        end = tl.minimum(start + chunk, n_valid)
        m_i = tl.zeros([REP_P], tl.float32) - float("inf")
        l_i = tl.zeros([REP_P], tl.float32)
        acc = tl.zeros([REP_P, D], tl.float32)
        slots = tl.arange(0, BLOCK_N)  # [BLOCK_N] slots of one block
        for n in tl.range(start, end, BLOCK_N):  # chunk is a multiple of BLOCK_N: n starts a block
            blk = tl.load(BT + b.to(tl.int64) * stride_bt + n // BLOCK_N).to(tl.int64)
            kb = K + blk * stride_kb + hk * stride_kh
            vb = V + blk * stride_vb + hk * stride_vh
            kmask = n + slots < end
            k = tl.load(kb + slots[:, None] * stride_ks + d[None, :], mask=kmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [REP_P, BLOCK_N] fp32, log2 units
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vb + slots[:, None] * stride_vs + d[None, :], mask=kmask[:, None], other=0.0)
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


def kernel_ok(q: Tensor, k_pool: Tensor) -> bool:
    """`kernel_runs` for this call, with the head_dim contiguous in the pool."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.stride(3) != 1 or k_pool.shape[2] != BLOCK:
        return False
    return kernel_runs(q.device, q.dtype, q.shape[1], k_pool.shape[1], q.shape[2])


def num_chunks(rows: int, kv_heads: int, max_len: int, block_n: int = BLOCK) -> int:
    """Chunks per (sequence, kv head): enough programs to fill the GPU, each chunk at least one block; a power of
    two, because the merge kernel is compiled per chunk count (a prefill's row counts would each compile one)."""
    want = 1 << (-(-MIN_PROGRAMS // max(rows * kv_heads, 1)) - 1).bit_length()  # rounded up
    blocks = max(1, -(-max_len // block_n))
    return min(want, 1 << (blocks.bit_length() - 1))  # at most the blocks, rounded down


def _decode_attention_triton(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_lens: Tensor, block_table: Tensor, chunks: int | None = None
) -> Tensor:
    B, H, D = q.shape
    Hkv = k_pool.shape[1]
    S = block_table.shape[1] * BLOCK  # the longest a sequence can be
    rep = H // Hkv
    ns = chunks or num_chunks(B, Hkv, S)
    q = q if q.stride(2) == 1 else q.contiguous()
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    pm = torch.empty(B, H, ns, device=q.device, dtype=torch.float32)
    pl, pa = torch.empty_like(pm), torch.empty(B, H, ns, D, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    _decode_partial_kernel[(B, Hkv, ns)](
        q, k_pool, v_pool, kv_lens, block_table, pm, pl, pa, S, D**-0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), block_table.stride(0), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), D=D, BLOCK_N=BLOCK, num_warps=4, num_stages=3,
    )  # fmt: skip
    _decode_merge_kernel[(B * H,)](pm, pl, pa, out, NS=ns, NS_P=triton.next_power_of_2(ns), D=D)
    return out


@torch.library.custom_op("batchvl::decode_attention", mutates_args=())
def decode_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_lens: Tensor, block_table: Tensor
) -> Tensor:
    """q [B, H, D] (one token per sequence) against the pool's k / v [N, Hkv, BLOCK, D] through block_table [B, W]
    (int32), slots < kv_lens[b] valid (each >= 1) -> [B, H, D]."""
    if kernel_ok(q, k_pool):
        return _decode_attention_triton(q, k_pool, v_pool, kv_lens, block_table)
    return decode_attention_reference(q, k_pool, v_pool, kv_lens, block_table)


@decode_attention.register_fake
def _(q, k_pool, v_pool, kv_lens, block_table):
    return q.new_empty(q.shape)  # contiguous, as the kernel and the reference return it
