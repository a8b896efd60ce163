"""Attention for packed (varlen) prefill: a flat token tensor plus `cu_seqlens`, no padding.

Backends, picked per engine by `prefill_backend` and run by `prefill_attention`:
- "sdpa": one causal SDPA call per sequence (the reference; any device);
- "packed": one custom op (`causal_attn_packed`) that picks its kernel per call from the host lengths
  (`packed_kernel`): cuDNN per sequence, faster than flash varlen for long sequences on Hopper once cuDNN has built
  its plans, or flash varlen, which also serves batches after a cached prefix. Deciding inside the op keeps one
  compiled layer graph for every case (a Python branch on the kernel or on a prefix would make Dynamo trace the
  layer once per case, at every start);
- "varlen" and "cudnn": those two kernels alone (parity checks).
The cuDNN path pads each sequence's call to a window of PER_SEQ_ROWS rows: a job's lengths map to a few plans.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchvl.ops.sdpa import sdpa_context


@dataclass
class AttnMeta:
    """Where each token of a packed batch sits: its sequence and its slot in the KV cache."""

    cu_seqlens: torch.Tensor  # [B+1] int32, prefix sums of the new tokens per sequence
    max_seqlen: int
    slot_b: torch.Tensor  # [T] int64, which pool block each token's k / v goes to
    slot_pos: torch.Tensor  # [T] int64, its slot in that block
    is_decode: bool = False
    kv_lens: torch.Tensor | None = (
        None  # [B] int64, each sequence's keys after this step (prefill: its last token's)
    )
    block_table: torch.Tensor | None = None  # [B, W] int32, each sequence's pool blocks
    prefix_lens: list[int] | None = None  # prefill: tokens already in the cache per sequence (prefix cache)
    # prefill after a cached prefix: every key each sequence sees (prefix + new), packed
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32
    max_seqlen_k: int = 0
    key_rows: torch.Tensor | None = None  # [Tk] int64, pool blocks
    key_pos: torch.Tensor | None = None  # [Tk] int64, slots in them
    cu_seqlens_host: torch.Tensor | None = None  # cu_seqlens on the CPU (per-sequence loops without a sync)
    cu_seqlens_k_host: torch.Tensor | None = None  # cu_seqlens_k on the CPU
    backend: str = "sdpa"  # prefill: "sdpa" | "packed" | "varlen" | "cudnn" (`prefill_backend`)
    all_heads: bool = True  # every attention head on this GPU (False under tensor parallelism)


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10
    except Exception:  # noqa: BLE001
        return None
    return varlen_attn


_VARLEN = _varlen_fn()
_VARLEN_PARAMS = set(inspect.signature(_VARLEN).parameters) if _VARLEN is not None else set()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask=None) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, Hkv, D] -> [Lq, H, D] with GQA."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=causal
    )
    return out.transpose(0, 1)


def prefill_sdpa(q, k, v, meta: AttnMeta, k_cache=None, v_cache=None) -> torch.Tensor:
    """Reference: causal attention per sequence. After a cached prefix, each sequence's keys (prefix + new) are
    gathered from the pool (`meta.key_rows` / `key_pos`) and new token j sees keys <= prefix + j."""
    cu = meta.cu_seqlens.tolist()
    cu_k = meta.cu_seqlens_k.tolist() if meta.cu_seqlens_k is not None else None
    outs = []
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        p = meta.prefix_lens[i] if meta.prefix_lens else 0
        if p:
            rows, pos = meta.key_rows[cu_k[i] : cu_k[i + 1]], meta.key_pos[cu_k[i] : cu_k[i + 1]]
            kk, vv = k_cache[rows, :, pos], v_cache[rows, :, pos]  # [prefix + new, Hkv, D]
            n = e - s
            mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(diagonal=p)
            outs.append(_sdpa(q[s:e], kk, vv, causal=False, mask=mask))
        else:
            outs.append(_sdpa(q[s:e], k[s:e], v[s:e], causal=True))
    return torch.cat(outs, 0)


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int) -> torch.Tensor:
    """Flash varlen, causal aligned bottom-right, GQA by the kernel where it can."""
    kw = {"window_size": (-1, 0)}  # causal, in torch 2.11 and 2.13 alike (2.11 has no is_causal)
    if "enable_gqa" in _VARLEN_PARAMS:
        kw["enable_gqa"] = True
    elif q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return _VARLEN(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def prefill_varlen(q, k, v, meta: AttnMeta, k_cache=None, v_cache=None) -> torch.Tensor:
    """Flash varlen attention over the packed batch (CUDA). After a cached prefix, the keys of each sequence
    (prefix + new) are gathered from the cache; flash aligns the causal mask bottom-right, as needed."""
    cu_q = meta.cu_seqlens.to(torch.int32)
    cu_k, max_k = cu_q, meta.max_seqlen
    if meta.key_rows is not None:
        k, v = (
            k_cache[meta.key_rows, :, meta.key_pos],
            v_cache[meta.key_rows, :, meta.key_pos],
        )  # [Tk, Hkv, D]
        cu_k, max_k = meta.cu_seqlens_k, meta.max_seqlen_k
    return _varlen(q, k, v, cu_q, cu_k, meta.max_seqlen, max_k)


PER_SEQ_ROWS = 64  # causal_attn_per_seq computes each sequence over a window of a multiple of this many rows
# "cudnn" only for batches whose sequences average this many tokens: each call costs host time
PER_SEQ_MIN_MEAN = 1024


def per_seq_window(n: int) -> int:
    """The rows `causal_attn_per_seq` computes for a sequence of n tokens."""
    return -(-n // PER_SEQ_ROWS) * PER_SEQ_ROWS


def causal_attn_per_seq(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_host: torch.Tensor, backend: str
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] packed, cu_seqlens_host [B+1] (CPU) -> [T, H, D]: causal attention within each
    sequence, one SDPA call per sequence with `backend` tried first (GQA by SDPA's enable_gqa). Runs inside
    `causal_attn_packed`, so a compiled layer traces it as one node.

    Each call covers the sequence's rows plus the following ones up to a multiple of PER_SEQ_ROWS (zero rows past
    the end), all of one layout (contiguous [rows, heads, D]): so a job's lengths map to a handful of shapes and
    strides, and cuDNN builds a handful of execution plans. The extra rows' outputs are dropped and, the mask being
    causal, the sequence's own queries never attend to them. The outputs are gathered by one cat (fewer launches
    than a copy per sequence)."""
    cu, T = cu_seqlens_host.tolist(), q.shape[0]
    q, k, v = (t.contiguous() for t in (q, k, v))  # cuDNN keys its plans on strides too (v is a view of qkv)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    with sdpa_context(backend, q.device):
        for s, e in itertools.pairwise(cu):
            n, w = e - s, per_seq_window(e - s)
            # rows n..w-1: the next sequence's, or zeros past the end
            rows = [t[s : s + w] for t in (q, k, v)]
            if s + w > T:
                rows = [F.pad(r, (0, 0, 0, 0, 0, s + w - T)) for r in rows]
            qs, ks, vs = (r.transpose(0, 1)[None] for r in rows)  # [1, heads, w, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            # [n, heads, D]; causal: the first n queries never saw rows n..w-1
            outs.append(o[0, :, :n].transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0].contiguous()


def packed_kernel(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    lengths: list[int],
    all_heads: bool,
    has_prefix: bool = False,
) -> str:
    """The kernel `causal_attn_packed` runs for one batch: "cudnn" per sequence on Hopper in bf16 / fp16 for long
    sequences without a cached prefix and with every head on this GPU (under tensor parallelism each call would
    carry a fraction of the work for the same host cost); else flash "varlen" where it runs; else "sdpa" per
    sequence."""
    half = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if not half:
        return "sdpa"
    hopper = torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device)[0] == 9
    if hopper and all_heads and not has_prefix and sum(lengths) >= PER_SEQ_MIN_MEAN * len(lengths):
        return "cudnn"
    return "varlen" if _VARLEN is not None and head_dim <= 256 else "sdpa"


def _after_prefix_per_seq(q, k, v, cu_q: list[int], cu_k: list[int]) -> torch.Tensor:
    """q packed [T, H, D] against each sequence's keys k / v [Tk, Hkv, D] (its cached prefix, then its new tokens):
    new token j of a sequence with p cached tokens sees keys <= p + j."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        n, m = qs.shape[0], ks.shape[0]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)
        outs.append(_sdpa(qs, ks, vs, causal=False, mask=mask))
    return torch.cat(outs, 0)


@torch.library.custom_op("batchvl::causal_attn_packed", mutates_args=())
def causal_attn_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_rows: torch.Tensor,
    key_pos: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_seqlens_k_host: torch.Tensor,
    all_heads: bool,
) -> torch.Tensor:
    """q [T, H, D], k / v [T, Hkv, D] packed, cu_seqlens [B+1] on q's device and on the CPU -> [T, H, D]: causal
    attention within each sequence through `packed_kernel`'s choice for these lengths. After a cached prefix
    (key_rows non-empty), each sequence attends to its keys in the pool, k_cache / v_cache [blocks, Hkv, BLOCK, D]
    at key_rows / key_pos [Tk] (its prefix, then its new tokens), packed by cu_seqlens_k [B+1]; else k / v."""
    lengths = cu_seqlens_host.diff().tolist()
    prefix = key_rows.numel() > 0
    kernel = packed_kernel(q.device, q.dtype, q.shape[2], lengths, all_heads, prefix)
    cu_q = cu_seqlens.to(torch.int32)
    if prefix:
        k, v = k_cache[key_rows, :, key_pos], v_cache[key_rows, :, key_pos]  # [Tk, Hkv, D]
        if kernel == "varlen":
            max_k = int(cu_seqlens_k_host.diff().max())
            return _varlen(q, k, v, cu_q, cu_seqlens_k.to(torch.int32), max(lengths), max_k)
        return _after_prefix_per_seq(q, k, v, cu_seqlens_host.tolist(), cu_seqlens_k_host.tolist())
    if kernel == "varlen":
        return _varlen(q, k, v, cu_q, cu_q, max(lengths), max(lengths))
    return causal_attn_per_seq(q, k, v, cu_seqlens_host, "cudnn" if kernel == "cudnn" else "auto")


@causal_attn_packed.register_fake
def _(q, k, v, cu_seqlens, cu_seqlens_host, k_cache, v_cache, key_rows, key_pos, cu_seqlens_k, cu_seqlens_k_host,
      all_heads):  # fmt: skip
    return q.new_empty(q.shape)  # contiguous, as every kernel returns it


def prefill_per_seq(q, k, v, meta: AttnMeta, backend: str = "cudnn") -> torch.Tensor:
    """Packed causal prefill without a cached prefix, one SDPA call per sequence (see `causal_attn_per_seq`)."""
    cu = meta.cu_seqlens_host if meta.cu_seqlens_host is not None else meta.cu_seqlens.cpu()
    return causal_attn_per_seq(q, k, v.contiguous(), cu, backend)


def prefill_packed(q, k, v, meta: AttnMeta, k_cache=None, v_cache=None) -> torch.Tensor:
    """Packed causal prefill through `causal_attn_packed`; `meta` from `packed_meta(..., "packed")`, which always
    carries the prefix's key tensors (empty without one), so that both cases share a compiled graph."""
    if k_cache is None:  # (a prefill that writes no pool: parity checks)
        k_cache, v_cache = k, v
    # v is a view of the qkv output: made contiguous here, a compiled layer writes it in its RoPE kernel's pass
    return causal_attn_packed(q, k, v.contiguous(), meta.cu_seqlens, meta.cu_seqlens_host, k_cache, v_cache,
                              meta.key_rows, meta.key_pos, meta.cu_seqlens_k, meta.cu_seqlens_k_host,
                              meta.all_heads)  # fmt: skip


def prefill_backend(q_device: torch.device, dtype: torch.dtype) -> str:
    """The prefill attention: on CUDA in bf16 / fp16 "packed" (the kernel chosen per call, a cached prefix or not);
    else the "sdpa" reference."""
    if not (q_device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)):
        return "sdpa"
    return "packed"


def prefill_attention(q, k, v, meta: AttnMeta, k_cache=None, v_cache=None) -> torch.Tensor:
    """q [T, H, D], k / v [T, Hkv, D] packed -> [T, H, D] through `meta.backend`."""
    if meta.backend == "packed":
        return prefill_packed(q, k, v, meta, k_cache, v_cache)
    if meta.backend == "cudnn":
        return prefill_per_seq(q, k, v, meta)
    if meta.backend == "varlen":
        return prefill_varlen(q, k, v, meta, k_cache, v_cache)
    return prefill_sdpa(q, k, v, meta, k_cache, v_cache)


def unbacked_batch_dims(meta: AttnMeta) -> None:
    """Keep a prefill's row count B and block-table width W symbolic in the compiled layers, a value of 1 included:
    Dynamo would otherwise give a lone row or a one-block batch graphs of their own.
    Marks meta's [B] / [B+1] tensors, its [B, W] block table and its prefix keys [Tk] (0 without a prefix), which
    only custom ops read. (Not the last layer's rows `last` [B]: an unbacked row count reaching an FP8 GEMM fails to
    trace, so the last-tokens path keeps a graph for one row.)"""
    from torch._dynamo.decorators import mark_unbacked

    for t, dim in ((meta.cu_seqlens, 0), (meta.cu_seqlens_host, 0), (meta.kv_lens, 0), (meta.cu_seqlens_k, 0),
                   (meta.cu_seqlens_k_host, 0), (meta.key_rows, 0), (meta.key_pos, 0), (meta.block_table, 0),
                   (meta.block_table, 1)):  # fmt: skip
        if t is not None:
            mark_unbacked(t, dim)
