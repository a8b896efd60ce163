"""Attention for packed (varlen) prefill: a flat token tensor plus `cu_seqlens`, no padding.

Backends, picked per engine by `prefill_backend` and run by `prefill_attention`:
- "sdpa": one causal SDPA call per sequence (the reference; any device);
- "packed": one custom op (`causal_attn_packed`) that picks its kernel per call from the host lengths
  (`packed_kernel`): cuDNN per sequence, faster than flash varlen for long sequences on Hopper once cuDNN has built
  its plans, or flash varlen, which also serves batches after a cached prefix. Deciding inside the op keeps one
  compiled layer graph for every case (a Python branch on the kernel or on a prefix would make Dynamo trace the
  layer once per case, at every start). After a cached prefix it attends in two parts merged by log-sum-exp
  (cascade attention): every query of the rows sharing a prefix against that prefix's keys, read from the pool once
  for them all, and each row's queries causally against its own new keys. (Gathering each row's copy of the prefix,
  as the reference does, moved 125 copies of a 1792-token prefix per layer in the 38B caches job's batches.)
- "varlen" and "cudnn": those two kernels alone (parity checks).
The cuDNN path pads each sequence's call to a window of PER_SEQ_ROWS rows: a job's lengths map to a few plans.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchvl.ops.decode_attention import BLOCK
from batchvl.ops.lse_merge import merge_attn_
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
    cu_seqlens_host: torch.Tensor | None = None  # cu_seqlens on the CPU (per-sequence loops without a sync)
    # prefill after a cached prefix ("packed"): `CascadePrefix`, the queries of each run of rows that share one
    prefix: CascadePrefix | None = None
    backend: str = "sdpa"  # prefill: "sdpa" | "packed" | "varlen" | "cudnn" (`prefill_backend`)
    all_heads: bool = True  # every attention head on this GPU (False under tensor parallelism)


@dataclass
class CascadePrefix:
    """The shared-prefix part of a cascade prefill: group g (a run of consecutive rows whose cached prefix is the
    same pool blocks) has its queries' token indexes q_index[cu_q[g]:cu_q[g+1]] and its prefix's keys in the pool at
    key_rows / key_pos[cu_k[g]:cu_k[g+1]]. Empty tensors (cu_* = [0]) when no row has a prefix, so that one compiled
    graph serves both cases."""

    q_index: torch.Tensor  # [Tq] int64, tokens of the packed batch, group by group; empty: they are q[:Tq]
    key_rows: torch.Tensor  # [Tp] int64, pool blocks of each group's prefix, group by group
    key_pos: torch.Tensor  # [Tp] int64, slots in them
    cu_q: torch.Tensor  # [G+1] int32 on the device
    cu_q_host: torch.Tensor  # the same on the CPU
    cu_k: torch.Tensor  # [G+1] int32 on the device
    cu_k_host: torch.Tensor

    @staticmethod
    def build(
        lengths: list[int], prefix_lens: list[int], groups: list[int], table: torch.Tensor
    ) -> CascadePrefix:
        """From the sequences' new-token `lengths` and cached `prefix_lens`, `groups` (equal ids on consecutive rows:
        the same prefix blocks) and their block table [B, W] on the device."""
        starts = [0, *itertools.accumulate(lengths)]
        q_index: list[torch.Tensor] = []
        key_rows: list[torch.Tensor] = []
        key_pos: list[torch.Tensor] = []
        cu_q, cu_k = [0], [0]
        for i, (p, n) in enumerate(zip(prefix_lens, lengths, strict=True)):
            if not p:
                continue
            q_index.append(torch.arange(starts[i], starts[i] + n))
            if i and prefix_lens[i - 1] and groups[i - 1] == groups[i]:  # the group goes on
                if prefix_lens[i - 1] != p:
                    raise ValueError(
                        f"rows {i - 1} and {i} share a prefix group but cache {prefix_lens[i - 1]} / {p} tokens"
                    )
                cu_q[-1] += n
                continue
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + p)
            key_rows.append(torch.full((p,), i))
            key_pos.append(torch.arange(p))
        dev = table.device
        leading = q_index and int(q_index[-1][-1]) + 1 == cu_q[-1]
        if leading:  # the rows with a prefix come first: their queries are q[:Tq]
            q_index = []
        cu_q_host, cu_k_host = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
        if key_rows:
            seq, kpos = torch.cat(key_rows).to(dev), torch.cat(key_pos).to(dev)
            rows, pos = table[seq, kpos // BLOCK].long(), kpos % BLOCK
        else:
            rows, pos = (torch.zeros(0, dtype=torch.long, device=dev) for _ in range(2))
        index = torch.cat(q_index).to(dev) if q_index else torch.zeros(0, dtype=torch.long, device=dev)
        # distinct tensors, with or without a prefix: inputs that alias differently would get a graph of their own
        return CascadePrefix(index, rows, pos, cu_q_host.to(dev, copy=True), cu_q_host, cu_k_host.to(dev, copy=True),
                             cu_k_host)  # fmt: skip


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


def _row_keys(meta: AttnMeta, i: int, n: int, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's keys and values in the pool, its cached prefix then its n new tokens: [prefix + n, Hkv, D]."""
    pos = torch.arange(meta.prefix_lens[i] + n, device=meta.block_table.device)
    rows = meta.block_table[i, pos // BLOCK].long()
    return k_cache[rows, :, pos % BLOCK], v_cache[rows, :, pos % BLOCK]


def prefill_sdpa(q, k, v, meta: AttnMeta, k_cache=None, v_cache=None) -> torch.Tensor:
    """Reference: causal attention per sequence. After a cached prefix, each sequence's keys (prefix + new) are
    gathered from the pool through its block table and new token j sees keys <= prefix + j."""
    cu = meta.cu_seqlens.tolist()
    outs = []
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        p = meta.prefix_lens[i] if meta.prefix_lens else 0
        if p:
            kk, vv = _row_keys(meta, i, e - s, k_cache, v_cache)  # [prefix + new, Hkv, D]
            n = e - s
            mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(diagonal=p)
            outs.append(_sdpa(q[s:e], kk, vv, causal=False, mask=mask))
        else:
            outs.append(_sdpa(q[s:e], k[s:e], v[s:e], causal=True))
    return torch.cat(outs, 0)


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool = True, lse: bool = False):
    """Flash varlen, causal aligned bottom-right, GQA by the kernel (keys never repeated); with `lse`, (out,
    lse [H, Tq] float32)."""
    # causal as a window, in torch 2.11 and 2.13 alike (2.11 has no is_causal)
    kw = {"window_size": (-1, 0) if causal else (-1, -1)}
    if lse:
        from torch.nn.attention.varlen import AuxRequest

        kw["return_aux"] = AuxRequest(lse=True)
    if "enable_gqa" in _VARLEN_PARAMS:  # torch >= 2.13 asks; 2.11's kernel takes fewer key heads as they are
        kw["enable_gqa"] = True
    out = _VARLEN(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    # lse: [heads, tokens], as torch's fake gives it (its docstring says [tokens, heads])
    if lse and tuple(out[1].shape) != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"varlen_attn's log-sum-exp is {tuple(out[1].shape)}, expected [heads, tokens]")
    return out


def prefill_varlen(q, k, v, meta: AttnMeta, k_cache=None, v_cache=None) -> torch.Tensor:
    """Flash varlen attention over the packed batch (CUDA; parity checks). After a cached prefix, each sequence's
    keys (prefix + new) are gathered from the pool; flash aligns the causal mask bottom-right, as needed."""
    cu_q = meta.cu_seqlens.to(torch.int32)
    cu_k, max_k = cu_q, meta.max_seqlen
    if meta.prefix_lens:
        lengths = meta.cu_seqlens.diff().tolist()
        keys = [_row_keys(meta, i, n, k_cache, v_cache) for i, n in enumerate(lengths)]
        k, v = torch.cat([kk for kk, _ in keys]), torch.cat([vv for _, vv in keys])  # [Tk, Hkv, D]
        total = torch.tensor([kk.shape[0] for kk, _ in keys])
        cu_k = F.pad(total.cumsum(0), (1, 0)).to(q.device, torch.int32)
        max_k = int(total.max())
    return _varlen(q, k, v, cu_q, cu_k, meta.max_seqlen, max_k)


ATTN_LSE_ROWS = 1024  # queries per step of `attn_lse` (bounds its [heads, rows, keys] scores)


def attn_lse(q, k, v, cu_q: list[int], cu_k: list[int], causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also gives its log-sum-exp, for the cascade where flash varlen does not run (any device; the
    math in float32): q [Tq, H, D] packed by cu_q, k / v [Tk, Hkv, D] by cu_k -> (out [Tq, H, D], lse [H, Tq]);
    causal aligned bottom-right."""
    rep, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    outs, lses = [], []
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        kk, vv = (t[ks:ke].repeat_interleave(rep, 1).float() for t in (k, v))  # [m, H, D]
        n, m = qe - qs, ke - ks
        for a in range(0, n, ATTN_LSE_ROWS):
            b = min(n, a + ATTN_LSE_ROWS)
            scores = torch.einsum("qhd,khd->hqk", q[qs + a : qs + b].float(), kk) * scale  # [H, rows, m]
            if causal:  # query j of the sequence sees keys <= j + m - n
                j = torch.arange(a, b, device=q.device)[:, None]
                scores = scores.masked_fill(torch.arange(m, device=q.device) > j + (m - n), float("-inf"))
            lse = scores.logsumexp(-1)  # [H, rows]
            outs.append(torch.einsum("hqk,khd->qhd", (scores - lse[..., None]).exp(), vv).to(q.dtype))
            lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


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


@torch.library.custom_op("batchvl::causal_attn_packed", mutates_args=())
def causal_attn_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_q: torch.Tensor,
    prefix_rows: torch.Tensor,
    prefix_pos: torch.Tensor,
    cu_prefix_q: torch.Tensor,
    cu_prefix_q_host: torch.Tensor,
    cu_prefix_k: torch.Tensor,
    cu_prefix_k_host: torch.Tensor,
    all_heads: bool,
) -> torch.Tensor:
    """q [T, H, D], k / v [T, Hkv, D] packed, cu_seqlens [B+1] on q's device and on the CPU -> [T, H, D]: causal
    attention within each sequence through `packed_kernel`'s choice for these lengths. After a cached prefix (the
    fields of `CascadePrefix`, cu_prefix_q_host[-1] > 0), the queries prefix_q (or q[:Tq] when it is empty) attend
    to their group's prefix keys in the pool, k_cache / v_cache [blocks, Hkv, BLOCK, D] at prefix_rows / prefix_pos,
    and every query to its own sequence's new keys k / v; the two merge by log-sum-exp."""
    lengths = cu_seqlens_host.diff().tolist()
    tq = int(cu_prefix_q_host[-1])
    kernel = packed_kernel(q.device, q.dtype, q.shape[2], lengths, all_heads, tq > 0)
    cu_q = cu_seqlens.to(torch.int32)
    if not tq:
        if kernel == "varlen":
            return _varlen(q, k, v, cu_q, cu_q, max(lengths), max(lengths))
        return causal_attn_per_seq(q, k, v, cu_seqlens_host, "cudnn" if kernel == "cudnn" else "auto")
    kp, vp = k_cache[prefix_rows, :, prefix_pos], v_cache[prefix_rows, :, prefix_pos]  # [Tp, Hkv, D]
    qp = q[:tq] if prefix_q.numel() == 0 else q[prefix_q]  # [Tq, H, D]
    if kernel == "varlen":
        o, lse = _varlen(q, k, v, cu_q, cu_q, max(lengths), max(lengths), lse=True)
        max_q, max_k = (int(c.diff().max()) for c in (cu_prefix_q_host, cu_prefix_k_host))
        op, lse_p = _varlen(qp, kp, vp, cu_prefix_q, cu_prefix_k, max_q, max_k, causal=False, lse=True)
    else:
        cu = cu_seqlens_host.tolist()
        o, lse = attn_lse(q, k, v, cu, cu, causal=True)
        op, lse_p = attn_lse(qp, kp, vp, cu_prefix_q_host.tolist(), cu_prefix_k_host.tolist(), causal=False)
    if prefix_q.numel() == 0:
        merge_attn_(o[:tq], lse[:, :tq], op, lse_p)
    else:
        own = o[prefix_q]
        merge_attn_(own, lse[:, prefix_q], op, lse_p)
        o[prefix_q] = own
    return o


@causal_attn_packed.register_fake
def _(q, k, v, cu_seqlens, cu_seqlens_host, k_cache, v_cache, prefix_q, prefix_rows, prefix_pos, cu_prefix_q,
      cu_prefix_q_host, cu_prefix_k, cu_prefix_k_host, all_heads):  # fmt: skip
    return q.new_empty(q.shape)  # contiguous, as every kernel returns it


def prefill_per_seq(q, k, v, meta: AttnMeta, backend: str = "cudnn") -> torch.Tensor:
    """Packed causal prefill without a cached prefix, one SDPA call per sequence (see `causal_attn_per_seq`)."""
    cu = meta.cu_seqlens_host if meta.cu_seqlens_host is not None else meta.cu_seqlens.cpu()
    return causal_attn_per_seq(q, k, v.contiguous(), cu, backend)


def prefill_packed(q, k, v, meta: AttnMeta, k_cache=None, v_cache=None) -> torch.Tensor:
    """Packed causal prefill through `causal_attn_packed`; `meta` from `packed_meta(..., "packed")`, which always
    carries a `CascadePrefix` (empty without a cached prefix), so that both cases share a compiled graph."""
    if k_cache is None:  # (a prefill that writes no pool: parity checks)
        k_cache, v_cache = k, v
    c = meta.prefix
    # v is a view of the qkv output: made contiguous here, a compiled layer writes it in its RoPE kernel's pass
    return causal_attn_packed(q, k, v.contiguous(), meta.cu_seqlens, meta.cu_seqlens_host, k_cache, v_cache,
                              c.q_index, c.key_rows, c.key_pos, c.cu_q, c.cu_q_host, c.cu_k, c.cu_k_host,
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
    Marks meta's [B] / [B+1] tensors, its [B, W] block table and its cascade prefix's tensors (0 or 1 long without a
    prefix), which only custom ops read. (The last layer's rows `last` [B] are the builder's to mark: not with FP8
    linears, whose GEMMs fail to trace an unbacked row count.)"""
    from torch._dynamo.decorators import mark_unbacked

    c = meta.prefix
    cascade = (
        (c.q_index, c.key_rows, c.key_pos, c.cu_q, c.cu_q_host, c.cu_k, c.cu_k_host) if c is not None else ()
    )
    for t, dim in ((meta.cu_seqlens, 0), (meta.cu_seqlens_host, 0), (meta.kv_lens, 0), (meta.block_table, 0),
                   (meta.block_table, 1), *((t, 0) for t in cascade)):  # fmt: skip
        if t is not None:
            mark_unbacked(t, dim)
